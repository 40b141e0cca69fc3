"""Kill a service with SIGKILL mid-job, start it again: the job resumes and nothing changes."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import load_job
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from fedmq.services.engine.run import run_job as run_engine
from tests.conftest import REPO, assert_bit_identical
from tests.e2e.cluster import cluster

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker


def digits_with_a_users_strategy(text: str) -> str:
    """examples/digits.yaml with the counting strategy: state per client and on the server, extras."""
    return (
        text.replace("  name: digits ", "  name: 'tests.support.strategies:CountingDigits' ")
        .replace("strategy: {name: fedavg}", "strategy: {name: 'tests.support.strategies:Counting'}")
        .replace("per_round: 10, min_fit: 8", "per_round: 6, min_fit: 6")
    )


def digits_keeping_optimizer_state(text: str) -> str:
    """examples/digits.yaml with SGD momentum kept in each client's state between its rounds."""
    return (
        text.replace("lr: 0.05}", "lr: 0.05, momentum: 0.9, keep_optimizer_state: true}")
        .replace("per_round: 10, min_fit: 8", "per_round: 5, min_fit: 5")
    )


@pytest.mark.parametrize(
    "variant", [lambda text: text, digits_with_a_users_strategy, digits_keeping_optimizer_state],
    ids=["fedavg", "user-strategy", "optimizer-state-kept"],
)
def test_a_job_survives_sigkill_of_the_aggregator_a_learner_and_the_scheduler(
    tmp_path: Path, variant: Callable[[str], str]
) -> None:
    spec = tmp_path / "job.yaml"
    text = (REPO / "examples" / "digits.yaml").read_text().replace("rounds: 30", "rounds: 12")
    spec.write_text(variant(text))
    with cluster(tmp_path, learners=2) as c:
        c.wait_learners(2)
        job_id = c.fedmq("submit", str(spec)).stdout.strip()

        assert c.wait_for(lambda: c.job_round(job_id) >= 3, timeout=120)
        c.stop("aggregator", signal.SIGKILL)
        c.start("aggregator")  # same state directory: it must pick the job up

        assert c.wait_for(lambda: c.job_round(job_id) >= 5, timeout=120)
        c.stop("learner-0", signal.SIGKILL)  # its tasks go to the other; it keeps no client state
        c.start("learner", "learner-0", FEDMQ_REPLICA="0")

        assert c.wait_for(lambda: c.job_round(job_id) >= 7, timeout=120)
        c.stop("scheduler", signal.SIGKILL)
        c.start("scheduler")

        watched = c.fedmq("watch", job_id, "--json", timeout=300)
        assert watched.returncode == 0, watched.stderr + c.log("aggregator")[-2000:]
        result = json.loads(watched.stdout)
        assert [h["round"] for h in result["history"]] == list(range(13))
        assert '"job_resumed"' in c.log("aggregator") and '"job_resumed"' in c.log("scheduler")

    embedded = run_job(load_job(spec), Settings(state_dir=tmp_path / "embedded"))
    assert_bit_identical(load_state(result["model_path"])[0], load_state(embedded["model_path"])[0])
    engine = run_engine(load_job(spec), Settings(state_dir=tmp_path / "engine"))
    assert_bit_identical(load_state(result["model_path"])[0], load_state(engine["model_path"])[0])
    assert [h["metrics"].get("strategy") for h in result["history"]] == [
        h["metrics"].get("strategy") for h in embedded["history"]], "the strategy's state was restored"
