"""Every service's way with a delivery: decode, sender check, rejection, the retry of a state write
that failed, the ack, and the group commit.

    delivery ─▶ decode (within the frame, or the spool file's limit) ─▶ a type this queue takes?
             ─▶ may its broker user send it? (common/senders.py) ─▶ the service's handler:
                 returns None   ─▶ acked (its effect is on disk and published; a handler that
                                   wrote resets the retry's backoff itself)
                 returns KEPT   ─▶ the service settles it later: a GroupCommit acks it with the
                                   others once their effect is saved together
                 StateUnwritable ─▶ unacked, handled again after the retry's backoff (stateretry.py)
                 DecodeError, ValidationError ─▶ rejected
             rejected: logged `message_rejected` with its reason, and dead-lettered as
             "<reason>: <detail>" (the reason the counts use)

    GroupCommit: deliveries whose effects are staged ─▶ once the deliveries that arrived are handled
    (Bus.call_when_idle), or when asked, saved at once ─▶ acked together; a save the disk refused
    is tried again after the backoff, its deliveries unacked meanwhile (or handed to `failed`)

The scheduler saves its job rows that way (scheduler/service.py); the aggregator stores, announces
and acks its updates that way, and holds its queue behind a failed write (aggregator/commit.py);
a learner acks a task once its reply is confirmed (learner/service.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Generic, Literal, TypeVar

import structlog

from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.errors import DecodeError, StateUnwritable, ValidationError
from fedmq.common.messages import Message, from_wire
from fedmq.common.senders import check_sender
from fedmq.common.stateretry import StateRetry

log = structlog.get_logger("fedmq.inbox")

Decode = Callable[[Delivery], Message]
KEPT: Literal["kept"] = "kept"  # a handler's answer: it keeps the delivery, to settle it later
Handled = Literal["kept"] | None
Handler = Callable[[Message, Delivery], Handled]
T = TypeVar("T")


def reject(delivery: Delivery, reason: str, detail: str = "", logger: Any = log) -> None:
    """Dead-letter a delivery with its reason, and say so (in `logger`: the service's)."""
    logger.warning("message_rejected", queue=delivery.queue, reason=reason, detail=detail[:500])
    delivery.reject(f"{reason}: {detail}" if detail else reason)


class Inbox:
    """Decodes a queue's deliveries, keeps those of the types it takes from the users who may send
    them, and rejects the rest (`reject`); `refused` hears of each message refused by sender, with
    the reason."""

    def __init__(
        self,
        senders: Mapping[str, frozenset[str]],
        max_bytes: int,
        takes: tuple[type[Message], ...] = (),
        decode: Decode | None = None,
        refused: Callable[[Message, str], None] | None = None,
        service: str = "inbox",
        retry: StateRetry | None = None,
        unwritable: Callable[[StateUnwritable, Delivery], None] | None = None,
    ) -> None:
        """`retry`: the service's backoff for state writes, if it writes any; `unwritable`: what
        `handle` does with a delivery whose handler could not write its state (by default, handle
        it again after the backoff)."""
        self.log = structlog.get_logger(f"fedmq.{service}")
        self.senders = senders
        self.takes = takes
        self._decode = decode or (lambda delivery: from_wire(delivery.body, max_bytes=max_bytes))
        self._refused = refused
        self.retry = retry
        self._unwritable = unwritable

    def handle(self, delivery: Delivery, handler: Handler) -> None:
        """`open` the delivery, then run `handler` on its message and settle the delivery by its
        outcome (the module docstring): acked, kept, handled again later, or rejected."""
        msg = self.open(delivery)
        if msg is None:
            return
        try:
            outcome = handler(msg, delivery)
        except StateUnwritable as exc:  # not the message's fault: kept unacked, and handled again
            if self._unwritable is not None:
                self._unwritable(exc, delivery)
            elif self.retry is not None:
                self.retry.later(exc, functools.partial(self.handle, delivery, handler))
            else:  # a service that writes no state (a learner): a bug, as the bus reports one
                raise
            return
        except (DecodeError, ValidationError) as exc:
            reason = exc.reason if isinstance(exc, ValidationError) else "decode"
            if self._refused is not None:
                self._refused(msg, reason)
            reject(delivery, reason, exc.detail if isinstance(exc, ValidationError) else str(exc), self.log)
            return
        if outcome != KEPT:
            delivery.ack()

    def open(self, delivery: Delivery) -> Message | None:
        """The delivery's message, or None: rejected (undecodable, unexpected, or a wrong sender)."""
        try:
            msg = self._decode(delivery)
            if self.takes and not isinstance(msg, self.takes):
                raise DecodeError(f"unexpected message type {msg.type!r} on {delivery.queue}")  # type: ignore[attr-defined]
        except DecodeError as exc:
            reject(delivery, "decode", str(exc), self.log)
            return None
        try:
            check_sender(msg.type, delivery.user_id, self.senders)  # type: ignore[attr-defined]
        except ValidationError as exc:
            if self._refused is not None:
                self._refused(msg, exc.reason)
            reject(delivery, exc.reason, exc.detail, self.log)
            return None
        return msg


class GroupCommit(Generic[T]):
    """Deliveries kept with an item each (what their handling staged), saved together by `save`,
    then acked together.

    A save that raises StateUnwritable is tried again after the retry's backoff, every delivery
    unacked meanwhile (their queue waits: prefetch); with `failed`, that one takes every exception
    of the save instead, with the deliveries it leaves unacked."""

    def __init__(
        self, bus: Bus, retry: StateRetry, save: Callable[[list[T]], None],
        failed: Callable[[Exception, list[Delivery]], None] | None = None,
    ) -> None:
        self.bus = bus
        self.retry = retry
        self.save = save
        self.failed = failed
        self._pending: list[tuple[Delivery, T]] = []

    def __bool__(self) -> bool:
        """Whether deliveries wait to be saved and acked."""
        return bool(self._pending)

    def add(self, delivery: Delivery, item: T) -> None:
        """Keep `delivery` until its item is saved with the others: once the deliveries that have
        arrived are handled, or at the next `flush`."""
        if not self._pending:
            self.bus.call_when_idle(self._when_idle)
        self._pending.append((delivery, item))

    def _when_idle(self) -> None:
        self.flush()

    def flush(self, then: Delivery | None = None) -> bool:
        """Save the kept items and ack their deliveries; False if the save failed. `then`, a
        delivery that was to follow them, is handed to `failed` with them (without `failed`, the
        caller keeps it)."""
        if not self._pending:
            return True
        pending, self._pending = self._pending, []
        try:
            self.save([item for _, item in pending])
        except Exception as exc:
            if self.failed is not None:
                self.failed(exc, [delivery for delivery, _ in pending] + ([then] if then else []))
                return False
            if not isinstance(exc, StateUnwritable):  # a bug, not the disk (a save catches what it knows)
                for delivery, _ in pending:  # as the bus settles a handler that crashed
                    delivery.reject(f"handler_error: {type(exc).__name__}")
                raise
            self._pending = pending + self._pending  # tried again, with what comes meanwhile
            self.retry.later(exc, self._when_idle)
            return False
        self.retry.succeeded()
        for delivery, _ in pending:
            delivery.ack()
        return True
