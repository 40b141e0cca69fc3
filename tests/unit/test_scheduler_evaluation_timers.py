"""The round loop arms the deadlines of a federated evaluation too: its nudge sends the evaluation's
tasks again (not training's), and its deadline moves the evaluation on, which records the round and
opens the next one through the round loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Timer
from fedmq.common.messages import EvalTask, Message, RoundOpen, TrainTask, from_wire
from fedmq.common.settings import Settings
from fedmq.services.scheduler.jobs import SchedJob
from fedmq.services.scheduler.records import eval_clients
from fedmq.services.scheduler.service import SchedulerService
from tests.conftest import small_job


class Pending(Timer):
    def __init__(self, delay: float, callback: Callable[[], None]) -> None:
        self.delay, self.callback, self.cancelled = delay, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class Clocked:
    """A bus that keeps what the scheduler publishes and the timers it arms, fired by the test."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []
        self.timers: list[Pending] = []

    def publish(self, queue: str, body: bytes, **kwargs: Any) -> None:
        self.sent.append((queue, from_wire(body)))

    def publish_all(self, messages: Sequence[tuple[str, bytes]]) -> None:
        for queue, body in messages:
            self.publish(queue, body)

    def publish_event(self, topic: str, body: bytes) -> None:
        """Events are not what this test looks at."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        self.timers.append(Pending(delay, callback))
        return self.timers[-1]

    def armed(self) -> list[Pending]:
        return [t for t in self.timers if not t.cancelled]


def evaluating(tmp_path: Path) -> tuple[SchedulerService, Clocked, SchedJob]:
    """A job whose round 1 closed and whose clients now evaluate its model."""
    bus = Clocked()
    service = SchedulerService(Settings(state_dir=tmp_path), cast(Bus, bus))
    service.rows.open()
    spec = small_job(evaluate__federated={"clients": 2}, max_round_retries=0)
    job = SchedJob("j", spec, spec.model_dump(mode="json"), round=1, model_digest="d1")
    service.jobs[job.job_id] = job
    service.evaluation.start_evaluation(job, {"round": 1, "metrics": {}, "seconds": 1.0})
    return service, bus, job


def tasks(bus: Clocked) -> list[tuple[str, str, str, int]]:
    """What was sent, as (queue, type, task id, client)."""
    return [(queue, msg.type, msg.task_id, msg.client) for queue, msg in bus.sent
            if isinstance(msg, EvalTask | TrainTask)]


def test_an_evaluations_nudge_sends_its_eval_tasks_again(tmp_path: Path) -> None:
    _, bus, job = evaluating(tmp_path)
    first = tasks(bus)
    assert [client for _, _, _, client in first] == eval_clients(job.spec, 1)
    assert {kind for _, kind, _, _ in first} == {"eval_task"}
    deadline, nudge = sorted(bus.armed(), key=lambda t: -t.delay)
    assert nudge.delay < deadline.delay
    bus.sent.clear()
    nudge.callback()
    assert tasks(bus) == first, "the same EvalTasks, ids and queues, and no TrainTask"
    assert job.evaluation is not None, "a nudge does not end the evaluation"


def test_an_evaluations_deadline_records_the_round_and_opens_the_next(tmp_path: Path) -> None:
    _, bus, job = evaluating(tmp_path)
    assert job.evaluation is not None
    deadline = max(bus.armed(), key=lambda t: t.delay)
    job.evaluation.deadline = time.monotonic() - 1  # it has passed, with no client's report
    bus.sent.clear()
    deadline.callback()
    assert job.evaluation is None
    assert job.history[-1]["round"] == 1 and job.history[-1]["evaluated_by"] == 0
    assert "federated" not in job.history[-1]["metrics"], "below quorum: no federated metrics"
    opened = [msg for queue, msg in bus.sent if queue == topology.AGGREGATOR]
    assert len(opened) == 1 and isinstance(opened[0], RoundOpen) and opened[0].round == 2
    trained = [msg for _, msg in bus.sent if isinstance(msg, TrainTask)]
    assert sorted(task.client for task in trained) == opened[0].clients and job.round == 2
