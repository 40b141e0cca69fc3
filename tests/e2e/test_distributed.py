"""fedmq as separate processes over RabbitMQ, driven by the CLI like a user would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import load_job
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import REPO, assert_bit_identical
from tests.e2e.cluster import cluster


@pytest.mark.rabbitmq
def test_processes_train_the_example_to_exactly_the_embedded_weights(tmp_path: Path) -> None:
    with cluster(tmp_path, learners=3) as c:
        rows = c.wait_learners(3)
        assert sorted(r["rank"] for r in rows) == [0, 1, 2]
        assert all(r["device"] == "cpu" for r in rows)

        submitted = c.fedmq("submit", "examples/digits.yaml")
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()

        watched = c.fedmq("watch", job_id, "--json")
        assert watched.returncode == 0, watched.stderr + c.log("aggregator")[-3000:]
        result = json.loads(watched.stdout)
        assert result["status"] == "completed"
        assert len(result["history"]) == 31
        assert result["final"]["server.accuracy"] >= 0.92

        status = c.fedmq("status", "--json")
        assert [j["status"] for j in json.loads(status.stdout) if j["job_id"] == job_id] == ["completed"]
        assert c.stop_all() == {name: 0 for name in c.procs}, "SIGTERM must stop every service cleanly"

    distributed = load_state(result["model_path"])[0]
    embedded = run_job(load_job(REPO / "examples" / "digits.yaml"), Settings(state_dir=tmp_path / "embedded"))
    # transport.* is what this deployment's messages weighed (they carry the learner's name); every
    # metric of the model must match to the bit
    def model_metrics(final: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in final.items() if not k.startswith("transport.")}

    assert model_metrics(embedded["final"]) == model_metrics(result["final"])
    assert_bit_identical(distributed, load_state(embedded["model_path"])[0])


@pytest.mark.rabbitmq
def test_watch_of_a_failing_job_exits_non_zero_with_the_reason(tmp_path: Path) -> None:
    spec = tmp_path / "bad-plugin.yaml"
    spec.write_text(
        (REPO / "examples" / "digits.yaml").read_text().replace("rounds: 30", "rounds: 2")
        .replace("  name: digits ", "  name: 'tests.integration.train_plugins:Broken' ")
    )
    with cluster(tmp_path, learners=1, FEDMQ_LIVENESS_S="1") as c:
        c.wait_learners(1)
        submitted = c.fedmq("submit", str(spec), "--watch")
    assert submitted.returncode == 1
    # A Task that raises fails the job at once (clients.on_error: fail_job), naming where and why.
    assert "user code failed in learner train" in submitted.stderr
    assert "simulated out-of-memory" in submitted.stderr and "RuntimeError" in submitted.stderr


def test_an_unreachable_broker_is_one_clear_line(tmp_path: Path) -> None:
    from tests.e2e.cluster import Cluster

    c = Cluster("amqp://someone:hunter2@127.0.0.1:1/", tmp_path)
    for args in (["submit", "examples/digits.yaml"], ["status"], ["learners"], ["watch", "x"]):
        proc = c.fedmq(*args, timeout=60)
        assert proc.returncode == 3, args
        assert "cannot reach RabbitMQ at amqp://someone:***@127.0.0.1:1/" in proc.stderr
        assert "hunter2" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.rabbitmq
def test_sigterm_mid_task_returns_the_task_and_the_job_completes_elsewhere(tmp_path: Path) -> None:
    spec = tmp_path / "slow.yaml"
    spec.write_text(
        (REPO / "examples" / "digits.yaml").read_text()
        .replace("rounds: 30", "rounds: 1").replace("total: 10, per_round: 10, min_fit: 8", "total: 2")
        .replace("  name: digits ", "  name: 'tests.integration.train_plugins:Gated' ")
    )
    gate = tmp_path / "training-may-finish"  # until it exists, every training waits
    with cluster(tmp_path, learners=1, FEDMQ_TEST_TRAIN_GATE=str(gate)) as c:
        c.wait_learners(1)
        job_id = c.fedmq("submit", str(spec)).stdout.strip()
        busy = c.wait_for(lambda: '"task_trained"' not in c.log("learner-0")
                          and any(r["busy"] for r in c.learner_rows()))
        assert busy
        [stopped] = [row["learner"] for row in c.learner_rows()]
        assert c.stop("learner-0") == 0  # SIGTERM while it trains
        # It said goodbye: `fedmq learners` drops it at once, not idle and later lost.
        assert all(row["learner"] != stopped for row in c.learner_rows()), c.learner_rows()
        gate.touch()
        c.start("learner", "learner-1", FEDMQ_REPLICA="1")
        watched = c.fedmq("watch", job_id, "--json")
    assert watched.returncode == 0, watched.stderr
    assert json.loads(watched.stdout)["status"] == "completed"
    assert '"task_trained"' not in c.log("learner-0"), "the stopped learner must not finish"
    assert '"task_redelivered"' in c.log("learner-1")


@pytest.mark.rabbitmq
def test_watching_a_job_that_already_ended_reports_its_model(tmp_path: Path) -> None:
    spec = tmp_path / "short.yaml"
    spec.write_text((REPO / "examples" / "digits.yaml").read_text().replace("rounds: 30", "rounds: 2"))
    with cluster(tmp_path, learners=1) as c:
        c.wait_learners(1)
        job_id = c.fedmq("submit", str(spec), "--watch").stdout.strip().splitlines()[0]
        late = c.fedmq("watch", job_id, "--json")  # the job is over before this watcher starts
    assert late.returncode == 0, late.stderr
    result = json.loads(late.stdout)
    assert result["status"] == "completed"
    assert Path(result["model_path"]).is_file()
    assert [h["round"] for h in result["history"]] == [0, 1, 2]
