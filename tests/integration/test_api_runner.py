"""The Python API's Runner, on the engine and on the services: a run it stops following (a callback
raises, Ctrl-C, a timeout) leaves no job training unwatched, recorded as cancelled, and its services
are gone when the `with` block ends."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import fedmq
from fedmq.services.engine.journal import stored_jobs
from fedmq.services.scheduler.store import JobRows
from tests.conftest import small_job


class Boom(Exception):
    pass


class FailsInRound(fedmq.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_round_end(self, round: int, record: fedmq.RoundRecord) -> None:
        if round == self.at:
            raise Boom(f"my callback broke in round {round}")


def statuses(state_dir: Path, services: bool) -> dict[str, str]:
    if not services:
        return {job.job_id: job.status for job in stored_jobs(state_dir)}
    rows = JobRows(state_dir / "scheduler" / "jobs.sqlite")
    rows.open()
    return {row["job_id"]: row["status"] for row in rows.load()}


@pytest.mark.parametrize("services", [False, True], ids=["engine", "services"])
def test_a_callback_that_raises_cancels_its_job_and_the_runner_goes_on(
    tmp_path: Path, services: bool
) -> None:
    before = set(threading.enumerate())
    with fedmq.Runner(state_dir=tmp_path, services=services) as runner:
        with pytest.raises(Boom, match="round 1"):
            runner.run(small_job(rounds=30), callbacks=[FailsInRound(1)])
        after = runner.run(small_job(rounds=1))
        assert after.ok
    jobs = statuses(tmp_path, services)
    assert sorted(jobs.values()) == ["cancelled", "completed"], jobs
    assert set(threading.enumerate()) <= before, "the Runner's services stopped with the with block"


@pytest.mark.parametrize("services", [False, True], ids=["engine", "services"])
def test_a_run_interrupted_by_its_caller_leaves_nothing_for_the_next_runner_to_resume(
    tmp_path: Path, services: bool
) -> None:
    class CtrlC(fedmq.Callback):
        def on_round_start(self, round: int) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedmq.run(small_job(rounds=30), state_dir=tmp_path, callbacks=[CtrlC()], services=services)
    assert list(statuses(tmp_path, services).values()) == ["cancelled"]


def test_an_objective_no_round_reported_gives_no_best_model_but_says_why(tmp_path: Path) -> None:
    result = fedmq.run(small_job(rounds=1, objective={"metric": "server.acuracy"}), state_dir=tmp_path)
    assert result.ok and result.best is None
    with pytest.raises(LookupError, match=r"server\.acuracy was never reported.*server\.accuracy"):
        result.best_model()
    assert result.final_model() is not None


def test_sync_statistics_count_the_models_fetched_for_federated_evaluation(tmp_path: Path) -> None:
    spec = small_job(rounds=2, evaluate={"every": 2, "federated": {"clients": 2}})
    # The services' one learner: each global model crosses once (on the engine nothing crosses).
    result = fedmq.run(spec, state_dir=tmp_path, services=True)
    assert result.ok
    first, last = (result.history[r].sync["bytes_down"] for r in (1, 2))
    assert first > 0
    assert last == 2 * first, "round 2 fetched its start model to train and its new one to evaluate"
    assert result.sync_stats.bytes_received == 3 * first
