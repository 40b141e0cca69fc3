"""The broker closes every connection while learners upload chunked updates: no process dies.

A node restart or a load balancer closes connections from the broker's side. A learner caught
publishing (its training thread handing the update to the bus thread) must reconnect, and its
task be redelivered or its update republished; the job ends with the undisturbed weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import load_job
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import REPO, assert_bit_identical
from tests.e2e.cluster import Cluster, cluster
from tests.rabbit import close_connections

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker

LEARNERS = 3
CLOSES = 12  # at most; the closes stop once one landed on a publish (and LEAST_CLOSES were made)
LEAST_CLOSES = 3  # a close costs about a round (reconnects, redeliveries): the job may end first
ROUNDS = 20  # room for CLOSES closes: on a loaded machine a close lands on a publish less often
FRAME_BYTES = 64 * 1024  # the smallest frame: a 1.2 MB update goes as ~19 chunks


def chunked_job(tmp_path: Path, rounds: int = ROUNDS) -> Path:
    """The example, with a model large enough for chunked updates, short enough for a test."""
    spec = tmp_path / "chunked.yaml"
    spec.write_text(
        (REPO / "examples" / "digits.yaml").read_text()
        .replace("hidden: [128]", "hidden: [512, 512]").replace("rounds: 30", f"rounds: {rounds}")
        .replace("epochs: 5", "epochs: 1")
    )
    return spec


def trainings(c: Cluster) -> int:
    """Updates the learners have trained so far (each is published right after)."""
    return sum(c.log(f"learner-{i}").count('"task_trained"') for i in range(LEARNERS))


def publishes_failed(c: Cluster) -> int:
    """Learner publishes a close cut off (each is redone)."""
    return sum(c.log(f"learner-{i}").count('"publish_failed"') for i in range(LEARNERS))


def finished(c: Cluster) -> bool:
    return '"job_finished"' in c.log("scheduler")


def exited(c: Cluster) -> dict[str, int | None]:
    """The service processes that have exited, with their exit codes."""
    return {name: proc.returncode for name, proc in c.procs.items() if proc.poll() is not None}


def test_learners_survive_the_broker_closing_their_connections_mid_upload(tmp_path: Path) -> None:
    spec = chunked_job(tmp_path)
    # A commit per chunk: an upload takes ~19 broker round trips, a window a close can land in
    # (one 16 MiB transaction sends the 1.2 MB at once, too quickly for the test to catch it).
    with cluster(tmp_path, learners=LEARNERS, FEDMQ_FRAME_BYTES=str(FRAME_BYTES),
                 FEDMQ_BLOB_COMMIT_BYTES=str(FRAME_BYTES), FEDMQ_RETRY_INITIAL_S="0.2") as c:
        c.wait_learners(LEARNERS)
        job_id = c.fedmq("submit", str(spec)).stdout.strip()
        closes = 0
        for done in range(CLOSES):
            def trained_again(seen: int = trainings(c)) -> bool:
                return trainings(c) > seen or bool(exited(c)) or finished(c)

            # A learner has just trained: its chunked update is on its way to the broker.
            assert c.wait_for(trained_again, timeout=120), f"no training after {done} closes\n" + "".join(
                f"--- {name}\n{c.log(name)[-4000:]}\n" for name in c.procs)  # where it stalled, if ever
            if exited(c) or finished(c):
                break
            close_connections(c.url, "closed by the test")
            closes += 1
            if closes >= LEAST_CLOSES and c.wait_for(lambda: publishes_failed(c) > 0, timeout=2):
                break  # the case this test is for has happened: let the job end
        watched = c.fedmq("watch", job_id, "--json", timeout=120) if not exited(c) else None
        gone = exited(c)
        logs = {name: c.log(name) for name in c.procs}
    assert not gone, f"{gone} exited: " + "".join(logs[n][-3000:] for n in gone)
    assert watched is not None and watched.returncode == 0, logs["aggregator"][-3000:]
    result = json.loads(watched.stdout)
    failed = sum(logs[f"learner-{i}"].count('"publish_failed"') for i in range(LEARNERS))
    print(f"\n{closes} closes: {failed} learner publishes failed and were redone")
    assert closes >= LEAST_CLOSES, f"the job ended after {closes} closes: too few to test anything"
    assert failed >= 1, "no close landed on a publish: the test proved nothing"
    assert result["status"] == "completed"
    embedded = run_job(load_job(spec), Settings(state_dir=tmp_path / "embedded"))
    assert_bit_identical(load_state(result["model_path"])[0], load_state(embedded["model_path"])[0])
