"""The inbox every service reads through (common/inbox.py): one decode, one sender check, one way to
reject, with the reason the dead-letter counts use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from fedmq.common.bus.base import Delivery
from fedmq.common.errors import StateUnwritable, ValidationError
from fedmq.common.inbox import KEPT, GroupCommit, Inbox
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


class Retry:
    """A StateRetry that records what it would run after its backoff."""

    def __init__(self) -> None:
        self.later_calls: list[Callable[[], None]] = []
        self.resets = 0

    def later(self, exc: StateUnwritable, again: Callable[[], None]) -> None:
        self.later_calls.append(again)

    def succeeded(self) -> None:
        self.resets += 1


@dataclass
class Settled(Recorded):
    def ack(self) -> None:
        self.settled.append("ack")


FULL = StateUnwritable("x.sqlite", 28, "database or disk is full")


def handling(retry: Retry, refused: list[str] | None = None) -> Inbox:
    return Inbox(SENDERS, 1 << 20, retry=retry,  # type: ignore[arg-type]
                 refused=None if refused is None else lambda m, reason: refused.append(reason))


def test_a_handled_message_is_acked_a_kept_one_is_left_to_its_handler() -> None:
    retry = Retry()
    inbox = handling(retry)
    done, kept = Settled(to_wire(task()), "sched"), Settled(to_wire(task()), "sched")
    inbox.handle(done, lambda m, d: None)  # type: ignore[arg-type]
    inbox.handle(kept, lambda m, d: KEPT)  # type: ignore[arg-type]
    assert (done.settled, kept.settled, retry.resets) == (["ack"], [], 0)  # a handler that wrote resets


def test_a_message_its_handler_finds_invalid_is_rejected_with_the_reason_and_counted() -> None:
    refused: list[str] = []
    inbox = handling(Retry(), refused)
    delivery = Settled(to_wire(task()), "sched")

    def invalid(msg: Message, _: object) -> None:
        raise ValidationError("stale_round", "round 3 is not open")

    inbox.handle(delivery, invalid)  # type: ignore[arg-type]
    assert delivery.settled == ["stale_round: round 3 is not open"] and refused == ["stale_round"]


def test_a_message_whose_state_write_failed_stays_unacked_and_is_handled_again_after_the_backoff() -> None:
    retry = Retry()
    inbox = handling(retry)
    delivery = Settled(to_wire(task()), "sched")
    calls: list[int] = []

    def writes(msg: Message, _: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise FULL

    inbox.handle(delivery, writes)  # type: ignore[arg-type]
    assert delivery.settled == [] and len(retry.later_calls) == 1
    retry.later_calls[0]()  # the backoff is over
    assert delivery.settled == ["ack"] and len(calls) == 2


def test_a_group_commit_saves_once_and_acks_all_or_hands_them_to_failed_with_the_one_after() -> None:
    retry = Retry()
    idle: list[Callable[[], None]] = []
    saved: list[list[str]] = []
    bus = type("Bus", (), {"call_when_idle": lambda self, fn: idle.append(fn)})()
    group: GroupCommit[str] = GroupCommit(bus, retry, saved.append)  # type: ignore[arg-type]
    a, b = Settled(b"", "x"), Settled(b"", "x")
    group.add(a, "a")  # type: ignore[arg-type]
    group.add(b, "b")  # type: ignore[arg-type]
    assert len(idle) == 1 and group  # one save when the deliveries that came are handled
    idle[0]()
    assert (saved, a.settled, b.settled) == ([["a", "b"]], ["ack"], ["ack"])
    assert retry.resets == 1 and not group

    failed: list[tuple[Exception, list[Delivery]]] = []

    def full(items: list[str]) -> None:
        raise FULL

    stalling: GroupCommit[str] = GroupCommit(
        bus, retry, full, lambda e, ds: failed.append((e, ds)))  # type: ignore[arg-type]
    c, then = Settled(b"", "x"), Settled(b"", "x")
    stalling.add(c, "c")  # type: ignore[arg-type]
    assert not stalling.flush(then=then)  # type: ignore[arg-type]
    assert failed == [(FULL, [c, then])] and c.settled == [] and not stalling


def test_a_group_commit_whose_save_has_a_bug_rejects_what_it_held_and_says_so() -> None:
    bus = type("Bus", (), {"call_when_idle": lambda self, fn: None})()

    def broken(items: list[str]) -> None:
        raise TypeError("not JSON serializable")

    group: GroupCommit[str] = GroupCommit(bus, Retry(), broken)  # type: ignore[arg-type]
    held = Settled(b"", "x")
    group.add(held, "a")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        group.flush()
    assert held.settled == ["handler_error: TypeError"] and not group
