"""`fedmq plot`: a job's history as CSV rows and a figure of one line per metric, from any of its sources."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest
from typer.testing import CliRunner

from fedmq.services.cli.chart import default_metrics, metrics_figure
from fedmq.services.cli.history import JobHistory, from_document, pick, to_csv
from fedmq.services.cli.main import app
from fedmq.services.scheduler.jobs import SchedJob
from fedmq.services.scheduler.store import JobRows
from tests.conftest import small_job


def record(server_round: int, **metrics: dict[str, float]) -> dict[str, Any]:
    return {"round": server_round, "metrics": metrics, "clients": 5 if server_round else 0, "failed": 0,
            "num_examples": 100 * bool(server_round), "seconds": 0.5 * server_round,
            "model_digest": f"{server_round:064x}"}


HISTORY = [
    record(0, server={"loss": 2.3, "accuracy": 0.1}),
    record(1, train={"loss": 1.5}, transport={"update_bytes": 5e5}, server={"loss": 1.7, "accuracy": 0.6}),
    record(2, train={"loss": 1.1}, transport={"update_bytes": 5e5}, server={"loss": 1.2, "accuracy": 0.8}),
    record(3, train={"loss": 0.9}, transport={"update_bytes": 5e5}, server={"loss": 1.3, "accuracy": 0.7},
           federated={"accuracy": 0.75}),
]
JOB: dict[str, Any] = {
    "job_id": "digits-1a2b3c4d", "name": "digits", "status": "completed", "history": HISTORY,
    "best": {"round": 2, "value": 0.8, "model_digest": f"{2:064x}"},
    "objective": {"metric": "server.accuracy", "mode": "max"},
}


def test_the_csv_has_a_column_per_metric_and_an_empty_cell_where_a_round_has_none() -> None:
    table = list(csv.DictReader(io.StringIO(to_csv(HISTORY))))
    assert list(table[0]) == ["round", "clients", "failed", "num_examples", "seconds", "server.loss",
                              "server.accuracy", "train.loss", "transport.update_bytes", "federated.accuracy"]
    assert [row["server.accuracy"] for row in table] == ["0.1", "0.6", "0.8", "0.7"]
    assert table[0]["train.loss"] == "" and table[2]["federated.accuracy"] == ""
    assert table[3]["federated.accuracy"] == "0.75" and table[3]["seconds"] == "1.5"


def test_the_figure_draws_one_labelled_line_per_metric_over_the_rounds_that_report_it() -> None:
    job = JobHistory.of(JOB)
    names = default_metrics(job)
    assert names == ["server.loss", "server.accuracy", "train.loss", "federated.accuracy"]  # no bytes
    axes = metrics_figure(job, names).axes[0]
    assert [line.get_label() for line in axes.lines] == names
    lines = {line.get_label(): line for line in axes.lines}
    assert np.asarray(lines["server.accuracy"].get_xdata()).tolist() == [0, 1, 2, 3]
    assert np.asarray(lines["train.loss"].get_xdata()).tolist() == [1, 2, 3]
    assert np.asarray(lines["train.loss"].get_ydata()).tolist() == [1.5, 1.1, 0.9]
    assert (axes.get_xlabel(), axes.get_ylabel()) == ("round", "value")
    assert axes.get_title() == "digits (digits-1a2b3c4d)"
    one_measure = metrics_figure(job, ["server.accuracy", "federated.accuracy"]).axes[0]
    assert len(one_measure.lines) == 2 and one_measure.get_ylabel() == "accuracy"
    only_bytes = JobHistory.of({**JOB, "history": [record(1, transport={"update_bytes": 5e5})]})
    assert default_metrics(only_bytes) == ["transport.update_bytes"]  # rather than an empty plot


def test_the_png_is_an_image_with_something_drawn_on_it(tmp_path: Path) -> None:
    path = tmp_path / "metrics.png"
    metrics_figure(JobHistory.of(JOB), ["server.accuracy"]).savefig(path, format="png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (500, 800)  # 8 x 5 inches at 100 dpi
    assert pixels[..., :3].std() > 0.05, "not a blank canvas"


def test_an_unknown_metric_is_refused_naming_the_jobs_metrics() -> None:
    with pytest.raises(LookupError, match=r"no server\.acc \(its metrics: server\.loss, server\.accuracy"):
        metrics_figure(JobHistory.of(JOB), ["server.acc"])


def test_the_round_a_model_is_downloaded_from_is_the_last_the_best_or_the_one_named() -> None:
    job = JobHistory.of(JOB)
    assert [pick(job, which)["round"] for which in ("final", "best", 1, 0)] == [3, 2, 1, 0]
    with pytest.raises(LookupError, match=r"has no round 7 \(rounds 0 to 3\)"):
        pick(job, 7)
    running = JobHistory.of({**JOB, "status": "running"})
    with pytest.raises(LookupError, match="so far: it is still running"):
        pick(running, 7)
    with pytest.raises(LookupError, match="has no objective, so no best round"):
        pick(JobHistory.of({**JOB, "best": None, "objective": None}), "best")
    with pytest.raises(LookupError, match=r"no round reported its objective server\.acuracy yet"):
        pick(JobHistory.of({**JOB, "best": None, "objective": {"metric": "server.acuracy"}}), "best")
    with pytest.raises(LookupError, match="has no rounds yet"):
        pick(JobHistory.of({**JOB, "history": []}), "final")


def test_a_job_is_read_from_any_json_fedmq_writes_of_it() -> None:
    run_json = {"model_fetches": [2], **JOB, "final": {"server.accuracy": 0.7}}  # fedmq run --json
    status_json = [{**JOB, "job_id": "other-1"}, JOB]  # fedmq status JOB --json: a list
    assert from_document(run_json).records == HISTORY
    assert from_document(status_json, "digits-1a2b3c4d").name == "digits"
    assert from_document(JobHistory.of(JOB).as_json()) == JobHistory.of(JOB)  # plot --json, read back
    with pytest.raises(ValueError, match="holds 2 jobs: name one"):
        from_document(status_json)
    with pytest.raises(ValueError, match=r"no job nope in it \(it holds: other-1, digits-1a2b3c4d\)"):
        from_document(status_json, "nope")
    with pytest.raises(ValueError, match="`history` list of rounds"):
        from_document({"job_id": "x"})


def test_the_command_plots_and_exports_a_job_from_a_json_file(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps(JOB))
    out = CliRunner().invoke(app, [
        "plot", "--from", str(tmp_path / "run.json"), "--out", str(tmp_path / "m.png"),
        "--metric", "train.loss", "--csv", str(tmp_path / "m.csv"), "--json", str(tmp_path / "m.json"),
    ])
    assert out.exit_code == 0, out.output
    assert matplotlib.image.imread(tmp_path / "m.png")[..., :3].std() > 0.05
    assert (tmp_path / "m.csv").read_text() == to_csv(HISTORY)
    assert from_document(json.loads((tmp_path / "m.json").read_text())) == JobHistory.of(JOB)
    unknown = CliRunner().invoke(app, ["plot", "--from", str(tmp_path / "run.json"), "--metric", "x.y"])
    assert unknown.exit_code == 2 and "reported no x.y" in unknown.output
    assert CliRunner().invoke(app, ["plot", "--from", str(tmp_path / "none.json")]).exit_code == 2


def test_the_command_reads_a_local_runs_job_from_its_state_directory(tmp_path: Path) -> None:
    """What `fedmq run` keeps: the scheduler's rows in STATE/scheduler/jobs.sqlite; no broker asked."""
    spec = small_job(objective={"metric": "server.accuracy", "mode": "max"})
    rows = JobRows(tmp_path / "state" / "scheduler" / "jobs.sqlite")
    rows.open()
    for job_id, history in (("tiny-00000001", HISTORY[:2]), ("tiny-00000002", HISTORY)):
        rows.save(SchedJob(job_id=job_id, spec=spec, raw_spec=spec.model_dump(mode="json"), round=3,
                           status="completed", history=history, best=JOB["best"]))
    runner = CliRunner()
    out = runner.invoke(app, ["plot", "--state-dir", str(tmp_path / "state"),  # the latest job
                              "--out", str(tmp_path / "m.png"), "--json", str(tmp_path / "m.json")])
    assert out.exit_code == 0, out.output
    saved = json.loads((tmp_path / "m.json").read_text())
    assert (saved["job_id"], saved["name"], saved["history"]) == ("tiny-00000002", "tiny", HISTORY)
    assert saved["objective"] == {"metric": "server.accuracy", "mode": "max"}
    out = runner.invoke(app, ["plot", "tiny-00000001", "--state-dir", str(tmp_path / "state"),
                              "--json", str(tmp_path / "m.json"), "--out", str(tmp_path / "m.png")])
    assert out.exit_code == 0 and json.loads((tmp_path / "m.json").read_text())["history"] == HISTORY[:2]
    missing = runner.invoke(app, ["plot", "nope", "--state-dir", str(tmp_path / "state")])
    said = " ".join(missing.output.split())
    assert missing.exit_code == 2 and "holds no job nope (jobs there: tiny-00000001, tiny-00000002)" in said


def test_plot_logs_every_metric_per_round_to_tensorboard_where_it_reads_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    source = tmp_path / "job.json"
    source.write_text(json.dumps(JOB))
    result = CliRunner().invoke(app, ["plot", "--from", str(source), "--out", str(tmp_path / "m.png"),
                                      "--tensorboard", str(tmp_path / "tb")])
    assert result.exit_code == 0, result.output
    events = EventAccumulator(str(tmp_path / "tb" / "digits-1a2b3c4d"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert sorted(tags) == sorted(["server/loss", "server/accuracy", "train/loss", "transport/update_bytes",
                                   "federated/accuracy"])
    accuracy = [(e.step, round(e.value, 6)) for e in events.Scalars("server/accuracy")]
    assert accuracy == [(0, 0.1), (1, 0.6), (2, 0.8), (3, 0.7)]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
