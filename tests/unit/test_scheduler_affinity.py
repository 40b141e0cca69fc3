"""The scheduler sends a client whose learner keeps its state back to that learner's own queue, at
most that learner's share of the round, with the tag of the update its last close folded; a task
sent again (nudge, retry) and one whose learner is gone go to the shared queue."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from fedmq.common.bus import topology
from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.messages import Heartbeat, TrainTask, TrainTasks, from_wire
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
            msg = from_wire(body)
            assert isinstance(msg, TrainTask | TrainTasks)
            sent.extend((queue, task) for task in (msg.tasks() if isinstance(msg, TrainTasks) else [msg]))

    service.bus.publish_all = publish_all  # type: ignore[method-assign]
    for i, name in enumerate(learners):
        service.registry.heartbeat(Heartbeat(learner=name, node="n", replica=i, device="cpu", pid=1,
                                             interval_s=5.0), time.monotonic())
    return service, sent


def job_held_by(holders: dict[int, tuple[int, str, str]], kept: bool = True) -> SchedJob:
    spec = small_job(clients__total=6)
    config = {CLIENT_STATE: LEARNER_STATE if kept else True}
    return SchedJob("j", spec, spec.model_dump(mode="json"), round=3, model_digest="d", config=config,
                    holders=holders)


def test_a_client_goes_back_to_its_learner_with_the_version_it_keeps(tmp_path: Path) -> None:
    service, sent = service_with(tmp_path, ["A", "B"])
    job = job_held_by({0: (2, "A", "a2"), 1: (1, "B", "b1")})
    service.rounds._dispatch(job, 3, [0, 1, 2], to_holders=True)
    routed = {task.client: (queue, task.state_from, task.state_tag) for queue, task in sent}
    assert routed == {
        0: (topology.learner_queue("A"), 2, "a2"),
        1: (topology.learner_queue("B"), 1, "b1"),
        2: (topology.TASKS, 0, ""),  # never folded: no state anywhere, nothing to fetch
    }
    sent.clear()
    service.rounds._dispatch(job, 3, [0, 1])  # sent again (a nudge, a retry): A or B may be stuck
    again = [(queue, task.state_tag) for queue, task in sent]
    assert again == [(topology.TASKS, "a2"), (topology.TASKS, "b1")]


def test_a_learner_takes_back_at_most_its_share_of_the_round(tmp_path: Path) -> None:
    service, sent = service_with(tmp_path, ["A", "B"])
    job = job_held_by({c: (2, "A", f"a{c}") for c in range(4)})
    service.rounds._dispatch(job, 3, [0, 1, 2, 3], to_holders=True)
    queues = [queue for queue, _ in sent]
    assert queues.count(topology.learner_queue("A")) == 2 and queues.count(topology.TASKS) == 2
    assert all(task.state_holder == "A" for _, task in sent), "A may still use its copy off the shared queue"


def test_a_dead_learners_clients_go_to_the_shared_queue_and_its_waiting_tasks_are_sent_again(
    tmp_path: Path
) -> None:
    service, sent = service_with(tmp_path, ["A", "B"])
    job = job_held_by({0: (2, "A", "a"), 1: (2, "B", "b")})
    job.state = RoundState(round=3, clients=[0, 1], quorum=2, deadline=time.monotonic() + 60)
    service.jobs[job.job_id] = job
    service.rounds._dispatch(job, 3, [0, 1], to_holders=True)
    sent.clear()
    service.registry.heartbeat(Heartbeat(learner="B", node="n", replica=1, device="cpu", pid=1,
                                         interval_s=5.0), time.monotonic() + 100)
    assert service.registry.sweep(time.monotonic() + 100) == ["A"]
    service.rounds.redispatch_held("A")
    assert [(queue, task.client, task.state_holder) for queue, task in sent] == [(topology.TASKS, 0, "A")]


def test_without_learner_only_state_tasks_carry_no_version_and_use_the_shared_queue(tmp_path: Path) -> None:
    service, sent = service_with(tmp_path, ["A"])
    job = job_held_by({0: (2, "A", "a")}, kept=False)  # the strategy's state too (SCAFFOLD): always fetched
    service.rounds._dispatch(job, 3, [0], to_holders=True)
    routed = [(queue, task.state_from, task.state_holder) for queue, task in sent]
    assert routed == [(topology.TASKS, None, "")]


def test_a_close_records_who_holds_the_folded_clients_state() -> None:
    job = job_held_by({0: (1, "A", "a1")})
    state = RoundState(round=3, clients=[0, 1, 2, 3], quorum=2, deadline=0.0)
    for client, learner, tag in ((0, "B", "b3"), (1, "A", "a3"), (2, "A", "a3'"), (3, "A", "")):
        state.record_update(client, 10, learner, tag)
    assert not state.record_update(1, 10, "B", "b3'"), "a duplicate's announcement changes nothing"
    note_holders(job, [0, 1, 3], state)  # 2 reported too late to be folded
    assert job.holders == {0: (3, "B", "b3"), 1: (3, "A", "a3"), 3: (3, "", "")}


def test_a_round_whose_state_was_not_the_learners_alone_ends_the_record() -> None:
    job = job_held_by({0: (1, "A", "a1")}, kept=False)  # say, an older aggregator's config mid-job
    state = RoundState(round=2, clients=[0], quorum=1, deadline=0.0)
    state.record_update(0, 10, "A", "a2")
    note_holders(job, [0], state)
    assert job.holders is None, "a gap in the record would make state_from lie: fetch from now on"


def test_who_holds_what_survives_a_scheduler_restart(tmp_path: Path) -> None:
    job = job_held_by({0: (2, "A", "a"), 5: (1, "B", "b")})
    job.state = RoundState(round=3, clients=[0, 5], quorum=2, deadline=time.monotonic() + 60)
    job.state.record_update(5, 10, "B", "b3")
    rows = JobRows(tmp_path / "jobs.db")
    rows.open()
    rows.save(job)
    again = JobRows(tmp_path / "jobs.db")
    again.open()
    (loaded,) = [SchedJob(**fields) for fields in again.load()]
    assert loaded.holders == {0: (2, "A", "a"), 5: (1, "B", "b")}
    assert loaded.state is not None and loaded.state.learners == {5: ("B", "b3")}


def test_a_learner_running_a_ddp_rank_is_sent_no_task(tmp_path: Path) -> None:
    service, sent = service_with(tmp_path, ["A"])
    service.registry.heartbeat(Heartbeat(learner="A", node="n", replica=0, device="cpu", pid=1,
                                         interval_s=5.0, group="other-job/1"), time.monotonic())
    service.rounds._dispatch(job_held_by({0: (2, "A", "a")}), 3, [0], to_holders=True)
    assert [(queue, task.state_tag) for queue, task in sent] == [(topology.TASKS, "a")]


def test_a_learner_just_launched_into_a_ddp_group_is_sent_no_task(tmp_path: Path) -> None:
    service, sent = service_with(tmp_path, ["A"])  # its heartbeat does not say so yet
    ddp = job_held_by({})
    ddp.job_id, ddp.group = "ddp", {"members": ["A"]}
    service.jobs[ddp.job_id] = ddp
    service.rounds._dispatch(job_held_by({0: (2, "A", "a")}), 3, [0], to_holders=True)
    assert [(queue, task.state_tag) for queue, task in sent] == [(topology.TASKS, "a")]
