"""The inbox every service reads through (common/inbox.py): one decode, one sender check, one way to
reject, with the reason the dead-letter counts use."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedmq.common.inbox import Inbox
from fedmq.common.messages import DdpStop, Heartbeat, Message, TrainTask, to_wire

SENDERS = {"scheduler": frozenset({"sched"}), "learner": frozenset({"learn"})}


@dataclass
class Recorded:
    body: bytes
    user_id: str | None
    queue: str = "fedmq.tasks"
    settled: list[str] = field(default_factory=list)

    def reject(self, reason: str) -> None:
        self.settled.append(reason)


def task() -> TrainTask:
    return TrainTask(job_id="j", task_id="j:1:0", round=1, client=0, model_digest="d", spec={})


def test_a_message_of_a_type_the_queue_takes_from_a_user_who_may_send_it_comes_through() -> None:
    sent = task()
    delivery = Recorded(to_wire(sent), "sched")
    assert Inbox(SENDERS, 1 << 20, takes=(TrainTask,)).open(delivery) == sent  # type: ignore[arg-type]
    assert delivery.settled == []


def test_what_does_not_decode_is_not_expected_here_or_comes_from_the_wrong_user_is_rejected() -> None:
    refused: list[tuple[Message, str]] = []
    inbox = Inbox(SENDERS, 1 << 20, takes=(TrainTask, DdpStop), refused=lambda m, r: refused.append((m, r)))
    garbage = Recorded(b"\x93not msgpack", "sched")
    elsewhere = Recorded(to_wire(Heartbeat(learner="l", node="n", replica=0, device="cpu", pid=1,
                                           interval_s=5.0)), "learn")
    forged = Recorded(to_wire(task()), "learn")  # only the scheduler's users send tasks
    assert [inbox.open(d) for d in (garbage, elsewhere, forged)] == [None, None, None]  # type: ignore[arg-type]
    assert garbage.settled[0].startswith("decode: ")
    assert elsewhere.settled[0].startswith("decode: unexpected message type 'heartbeat' on fedmq.tasks")
    assert forged.settled[0].startswith("sender: train_task from broker user 'learn'")
    assert [(type(m).__name__, reason) for m, reason in refused] == [("TrainTask", "sender")]
