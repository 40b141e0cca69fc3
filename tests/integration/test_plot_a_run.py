"""`fedmq plot` of a job `fedmq run` trained: from its state directory and from its --json output alike."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from fedmq.services.cli.main import app
from tests.conftest import small_job


def test_a_local_run_plots_the_same_rounds_from_its_state_directory_and_its_json(tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = run_job(small_job(rounds=2), Settings(state_dir=state, log_format="json"), idle_timeout=60)
    assert result["status"] == "completed"
    (tmp_path / "run.json").write_text(json.dumps(result))  # what `fedmq run --json` prints
    exported = {}
    for source in (["--state-dir", str(state)], ["--from", str(tmp_path / "run.json")]):
        out = CliRunner().invoke(app, ["plot", result["job_id"], *source, "--out", str(tmp_path / "m.png"),
                                       "--json", str(tmp_path / "m.json")])
        assert out.exit_code == 0, out.output
        assert (tmp_path / "m.png").stat().st_size > 0
        exported[source[0]] = json.loads((tmp_path / "m.json").read_text())
    assert exported["--state-dir"] == exported["--from"]
    assert [r["round"] for r in exported["--from"]["history"]] == [0, 1, 2]
