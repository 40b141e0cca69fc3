"""Every service's first step with a delivery: the same decode, sender check and rejection.

    delivery ─▶ decode (within the frame, or the spool file's limit) ─▶ a type this queue takes?
             ─▶ may its broker user send it? (common/senders.py) ─▶ the message, to the handler
                 └─ any no ─▶ rejected: logged `message_rejected` with its reason, and
                              dead-lettered as "<reason>: <detail>" (the reason the counts use)

What comes after is each service's own: the aggregator stores updates and commits them together
(aggregator/commit.py), the scheduler saves its job rows together (scheduler/service.py), both
handling a message again when the disk refused it (common/stateretry.py); a learner acks a task
once its reply is confirmed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

from fedmq.common.bus.base import Delivery
from fedmq.common.errors import DecodeError, ValidationError
from fedmq.common.messages import Message, from_wire
from fedmq.common.senders import check_sender

log = structlog.get_logger("fedmq.inbox")

Decode = Callable[[Delivery], Message]


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
    ) -> None:
        self.log = structlog.get_logger(f"fedmq.{service}")
        self.senders = senders
        self.takes = takes
        self._decode = decode or (lambda delivery: from_wire(delivery.body, max_bytes=max_bytes))
        self._refused = refused

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
