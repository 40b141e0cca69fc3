"""A round's tasks travel as one message per learner serving a queue (TrainTasks): the scheduler
splits them by the learners it hears, a learner takes them as the TrainTasks they stand for, and
their one delivery is settled once all of them are."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from fedmq.common import codec
from fedmq.common.bus import topology
from fedmq.common.bus.base import SharedDelivery
from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.messages import (
    NEWER_FIELDS,
    EvalTask,
    Heartbeat,
    Message,
    ModelGet,
    RoundClosed,
    TrainTask,
    TrainTasks,
    batch_of,
    from_wire,
    to_wire,
)
from fedmq.common.settings import Settings
from fedmq.services.scheduler.jobs import SchedJob
from fedmq.services.scheduler.loop import with_model
from fedmq.services.scheduler.registry import Registry
from fedmq.services.scheduler.service import SchedulerService
from tests.conftest import small_job
from tests.unit.test_scheduler_group_save import Recorded


def beat(name: str, sites: list[str] | None = None, group: str = "") -> Heartbeat:
    return Heartbeat(learner=name, node="n", replica=0, device="cpu", pid=1, sites=sites or [], group=group)


def scheduler(tmp_path: Path, learners: int, batch: int) -> tuple[SchedulerService, list[tuple[str, bytes]]]:
    service = SchedulerService(Settings(state_dir=tmp_path, task_batch=batch), MemoryBroker().connect())
    sent: list[tuple[str, bytes]] = []

    def publish_all(messages: Sequence[tuple[str, bytes]]) -> None:
        sent.extend(messages)

    service.bus.publish_all = publish_all  # type: ignore[method-assign]
    for i in range(learners):
        service.registry.heartbeat(beat(f"l{i}"), time.monotonic())
    return service, sent


def dispatched(service: SchedulerService, sent: list[tuple[str, bytes]], clients: int) -> list[list[int]]:
    """The clients of each message a round of `clients` sends."""
    spec = small_job(clients__total=clients)
    job = SchedJob("j", spec, spec.model_dump(mode="json"), round=3, model_digest="d")
    service.rounds._dispatch(job, 3, list(range(clients)))
    out = []
    for queue, body in sent:
        assert queue == topology.TASKS
        msg = from_wire(body)
        assert isinstance(msg, TrainTask | TrainTasks)
        out.append([t.client for t in msg.tasks()] if isinstance(msg, TrainTasks) else [msg.client])
    return out


@pytest.mark.parametrize(("learners", "batch", "messages"), [
    (3, 64, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]),  # one a learner: its share
    (1, 64, [list(range(10))]),
    (3, 2, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]),  # FEDMQ_TASK_BATCH the most in one
    (3, 1, [[c] for c in range(10)]),  # one a task: as learners before TrainTasks read them
    (0, 64, [[c] for c in range(10)]),  # no learner heard yet: one a task, for any to take
    (20, 64, [[c] for c in range(10)]),
])
def test_a_rounds_tasks_go_as_one_message_per_learner_serving_the_queue(
    tmp_path: Path, learners: int, batch: int, messages: list[list[int]]
) -> None:
    service, sent = scheduler(tmp_path, learners, batch)
    assert dispatched(service, sent, 10) == messages


def test_a_batch_stands_for_the_tasks_it_was_made_of() -> None:
    spec = small_job().model_dump(mode="json")
    tasks = [TrainTask(job_id="j", task_id=f"j:3:{c}", round=3, client=c, model_digest="d", spec=spec,
                       config={"mu": 0.1}, state_from=2 if c else None, state_holder="n/1" if c else "",
                       state_tag="t" if c else "") for c in (4, 1)]
    assert batch_of(tasks[:1]) is tasks[0], "a lone task goes as itself"
    back = from_wire(to_wire(batch_of(tasks)))
    assert isinstance(back, TrainTasks)
    for sent, got in zip(tasks, back.tasks(), strict=True):
        assert isinstance(got, TrainTask)
        assert got.model_dump(exclude={"msg_id", "sent_at"}) == sent.model_dump(exclude={"msg_id", "sent_at"})
    assert len({t.msg_id for t in back.tasks()}) == 2


def test_the_learners_serving_a_queue_are_those_that_take_from_it() -> None:
    registry = Registry()
    now = time.monotonic()
    beats = (beat("a"), beat("b"), beat("s1", ["east"]), beat("s2", ["east", "west"]), beat("d", group="j/0"))
    for hb in beats:
        registry.heartbeat(hb, now)
    assert (registry.serving(None), registry.serving("east"), registry.serving("west")) == (2, 2, 1)


def test_a_shared_delivery_is_acked_once_every_task_is_and_goes_back_whole_if_one_does() -> None:
    whole = Recorded(b"", "q")
    shared = SharedDelivery(whole, 3)
    shared.ack()
    shared.ack()
    assert whole.settled == []
    shared.ack()
    assert whole.settled == ["ack"]

    whole = Recorded(b"", "q", redelivered=True)
    shared = SharedDelivery(whole, 2)
    assert shared.redelivered
    shared.requeue()
    shared.ack()
    assert whole.settled == ["requeue"], "the tasks already answered come again, as duplicates"


def test_a_model_goes_with_the_tasks_only_where_it_fits_the_learners_frame() -> None:
    task = TrainTask(job_id="j", task_id="j:1:0", round=1, client=0, model_digest="d", spec={})
    model = b"m" * 1000
    assert from_wire(with_model(task, model, 64 * 1024)).model == model  # type: ignore[attr-defined]
    assert from_wire(with_model(task, model, 900)).model == b"", (  # type: ignore[attr-defined]
        "too large: the learner fetches it")


@pytest.mark.parametrize("msg", [
    TrainTask(job_id="j", task_id="j:1:0", round=1, client=0, model_digest="d", spec={}),
    EvalTask(job_id="j", task_id="j:e1:0", round=1, client=0, model_digest="d", spec={}),
    RoundClosed(job_id="j", round=1, model_digest="d"),
    ModelGet(job_id="j", digest="d"),
])
def test_fields_newer_than_a_message_type_stay_off_the_wire_at_their_default(msg: Message) -> None:
    """So a build from before them, which refuses unknown fields, still reads the message."""
    sent = codec.unpackb(to_wire(msg))
    assert not set(NEWER_FIELDS) & set(sent)
    assert from_wire(to_wire(msg)) == msg
