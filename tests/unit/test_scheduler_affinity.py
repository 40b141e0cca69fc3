"""The scheduler sends a client whose learner keeps its state back to that learner's own queue, at
most that learner's share of the round, and to the shared queue once the learner is gone."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from fedmq.common.bus import topology
from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.messages import Heartbeat, TrainTask, from_wire
from fedmq.common.settings import Settings
from fedmq.common.strategy.contract import CLIENT_STATE, LEARNER_STATE
from fedmq.services.scheduler.jobs import SchedJob, note_holders
from fedmq.services.scheduler.rounds import RoundState
from fedmq.services.scheduler.service import SchedulerService
from fedmq.services.scheduler.store import JobRows
from tests.conftest import small_job


def service_with(tmp_path: Path, learners: list[str]) -> tuple[SchedulerService, list[tuple[str, TrainTask]]]:
    service = SchedulerService(Settings(state_dir=tmp_path), MemoryBroker().connect())
    sent: list[tuple[str, TrainTask]] = []

    def publish_all(messages: Sequence[tuple[str, bytes]]) -> None:
        for queue, body in messages:
            task = from_wire(body)
            assert isinstance(task, TrainTask)
            sent.append((queue, task))

    service.bus.publish_all = publish_all  # type: ignore[method-assign]
    for i, name in enumerate(learners):
        service.registry.heartbeat(Heartbeat(learner=name, node="n", replica=i, device="cpu", pid=1,
                                             interval_s=5.0), time.monotonic())
    return service, sent


def job_held_by(holders: dict[int, tuple[int, str]], kept: bool = True) -> SchedJob:
    spec = small_job(clients__total=6)
    config = {CLIENT_STATE: LEARNER_STATE if kept else True}
    return SchedJob("j", spec, spec.model_dump(mode="json"), round=3, model_digest="d", config=config,
                    holders=holders)


def test_a_client_goes_back_to_its_learner_with_the_version_it_keeps(tmp_path: Path) -> None:
    service, sent = service_with(tmp_path, ["A", "B"])
    job = job_held_by({0: (2, "A"), 1: (1, "B")})
    service._dispatch(job, 3, [0, 1, 2])
    routed = {task.client: (queue, task.state_from, task.state_holder) for queue, task in sent}
    assert routed == {
        0: (topology.learner_queue("A"), 2, "A"),
        1: (topology.learner_queue("B"), 1, "B"),
        2: (topology.TASKS, 0, ""),  # never folded: no state anywhere, nothing to fetch
    }


def test_a_learner_takes_back_at_most_its_share_of_the_round(tmp_path: Path) -> None:
    service, sent = service_with(tmp_path, ["A", "B"])
    job = job_held_by({c: (2, "A") for c in range(4)})
    service._dispatch(job, 3, [0, 1, 2, 3])
    queues = [queue for queue, _ in sent]
    assert queues.count(topology.learner_queue("A")) == 2 and queues.count(topology.TASKS) == 2
    assert all(task.state_holder == "A" for _, task in sent), "A may still use its copy off the shared queue"


def test_a_dead_learners_clients_go_to_the_shared_queue_and_its_waiting_tasks_are_sent_again(
    tmp_path: Path
) -> None:
    service, sent = service_with(tmp_path, ["A", "B"])
    job = job_held_by({0: (2, "A"), 1: (2, "B")})
    job.state = RoundState(round=3, clients=[0, 1], quorum=2, deadline=time.monotonic() + 60)
    service.jobs[job.job_id] = job
    service._dispatch(job, 3, [0, 1])
    sent.clear()
    service.registry.heartbeat(Heartbeat(learner="B", node="n", replica=1, device="cpu", pid=1,
                                         interval_s=5.0), time.monotonic() + 100)
    assert service.registry.sweep(time.monotonic() + 100) == ["A"]
    service._redispatch_held("A")
    assert [(queue, task.client, task.state_holder) for queue, task in sent] == [(topology.TASKS, 0, "A")]


def test_without_learner_only_state_tasks_carry_no_version_and_use_the_shared_queue(tmp_path: Path) -> None:
    service, sent = service_with(tmp_path, ["A"])
    job = job_held_by({0: (2, "A")}, kept=False)  # the strategy's state too (SCAFFOLD): always fetched
    service._dispatch(job, 3, [0])
    routed = [(queue, task.state_from, task.state_holder) for queue, task in sent]
    assert routed == [(topology.TASKS, None, "")]


def test_a_close_records_who_holds_the_folded_clients_state() -> None:
    job = job_held_by({0: (1, "A")})
    state = RoundState(round=3, clients=[0, 1, 2], quorum=2, deadline=0.0)
    for client, learner in ((0, "B"), (1, "A"), (2, "A")):
        state.record_update(client, 10, learner)
    note_holders(job, [0, 1], state)  # 2 reported too late to be folded
    assert job.holders == {0: (3, "B"), 1: (3, "A")}


def test_who_holds_what_survives_a_scheduler_restart(tmp_path: Path) -> None:
    job = job_held_by({0: (2, "A"), 5: (1, "B")})
    job.state = RoundState(round=3, clients=[0, 5], quorum=2, deadline=time.monotonic() + 60)
    job.state.record_update(5, 10, "B")
    rows = JobRows(tmp_path / "jobs.db")
    rows.open()
    rows.save(job)
    again = JobRows(tmp_path / "jobs.db")
    again.open()
    (loaded,) = [SchedJob(**fields) for fields in again.load()]
    assert loaded.holders == {0: (2, "A"), 5: (1, "B")}
    assert loaded.state is not None and loaded.state.learners == {5: "B"}
