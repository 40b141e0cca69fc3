"""The Bus interface every service talks through; RabbitMQ and in-memory implement it.

Threading contract (pika's, kept by both implementations): handlers, timers and
`call_soon` callbacks run on the bus's own dispatch thread, inside `run()`.
`publish`, `request`, `Delivery.ack`, `Delivery.reject`, `call_soon` and `stop`
may be called from any thread.
"""

from __future__ import annotations

import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from fedmq.common.codec.pack import Encoded


@dataclass(eq=False)
class Delivery(ABC):
    """One message handed to a consumer; it must be acked or rejected exactly once."""

    body: bytes  # a consumer that reads early without a spool may get a bytearray (bus/early.py)
    queue: str
    redelivered: bool = False
    reply_to: str | None = None
    correlation_id: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)
    # Who published it: the broker user (RabbitMQ checks it against the publisher's login;
    # a publisher may leave it out, so None is possible), or the in-memory bus's identity.
    user_id: str | None = None
    # A large message received into a file (consume(..., spool=DIR)): `body` is then empty.
    # The handler may move the file away; whatever is left is removed once the message is settled.
    body_path: Path | None = None

    @abstractmethod
    def ack(self) -> None:
        """The message is handled; the broker forgets it. Thread-safe."""

    @abstractmethod
    def reject(self, reason: str) -> None:
        """The message is bad: dead-letter it with the reason. Thread-safe."""

    @abstractmethod
    def requeue(self) -> None:
        """Give the message back for another consumer (shutdown mid-task). Thread-safe."""

    def live(self) -> bool:
        """Not settled, and still this consumer's: False once its connection is gone (the broker
        gives it again, to whoever consumes next), so work kept for it later may be dropped."""
        return True


class SharedDelivery(Delivery):
    """One delivery that several pieces of work came in (a TrainTasks' tasks), settled once each
    piece is: acked if every one was, dead-lettered if one was rejected, else given back whole."""

    def __init__(self, delivery: Delivery, pieces: int) -> None:
        super().__init__(b"", delivery.queue, delivery.redelivered, user_id=delivery.user_id)
        self._of = delivery
        self._left = pieces
        self._requeue = False
        self._rejected: str | None = None
        self._lock = threading.Lock()

    def ack(self) -> None:
        self._settle()

    def requeue(self) -> None:
        with self._lock:
            self._requeue = True
        self._settle()

    def reject(self, reason: str) -> None:
        with self._lock:
            self._rejected = self._rejected or reason
        self._settle()

    def live(self) -> bool:
        return self._of.live()

    @property
    def doomed(self) -> bool:
        """Whether it goes back (or to the dead letters) whatever its other pieces do: a piece was
        requeued or rejected, or its connection is gone."""
        return self._requeue or self._rejected is not None or not self._of.live()

    def _settle(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left != 0:
                return
        if self._rejected is not None:
            self._of.reject(self._rejected)
        elif self._requeue:
            self._of.requeue()
        else:
            self._of.ack()


def spool_file(spool: Path, fill: Callable[[BinaryIO], object], sync: bool) -> Path:
    """A new file in `spool` that `fill` writes (a large message received into a file), on disk
    before this returns when `sync`; a failure leaves no file."""
    spool.mkdir(parents=True, exist_ok=True)
    path = spool / f"{uuid.uuid4().hex}.msg"
    try:
        with open(path, "wb") as f:
            fill(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


Handler = Callable[[Delivery], None]
# What may be published: bytes, or an encoding still in its parts (a large message is sent from
# them chunk by chunk, never joined; its tensors must not change until publish returns, or ever
# when it is owned: the in-memory bus then reads them on the consumer's thread).
Body = bytes | Encoded
EventHandler = Callable[[bytes], None]


class Timer(ABC):
    @abstractmethod
    def cancel(self) -> None: ...


class Bus(ABC):
    """Publish, consume with ack/reject, request/reply, and timers on one dispatch thread."""

    # Called with the reason of every message this bus dead-letters (a metrics hook).
    on_dead_letter: Callable[[str], None] | None = None

    @abstractmethod
    def publish(
        self,
        queue: str,
        body: Body,
        *,
        reply_to: str | None = None,
        correlation_id: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> None:
        """Send to a named queue; returns once the broker holds the message."""

    def publish_all(self, messages: Sequence[tuple[str, bytes]]) -> None:
        """Publish each (queue, body) in order; returns once the broker holds them all. A failure
        may leave some sent, as publishing one at a time would: a caller's handling is idempotent."""
        for queue, body in messages:
            self.publish(queue, body)

    @abstractmethod
    def publish_event(self, topic: str, body: bytes) -> None:
        """Fan out to every subscriber whose pattern matches `topic` (best effort)."""

    @abstractmethod
    def consume(
        self, queue: str, handler: Handler, *, prefetch: int = 1, spool: Path | None = None,
        read_early: bool = False,
    ) -> None:
        """Deliver the queue's messages to `handler`, at most `prefetch` unacked at a time.

        With `spool`, a message too large for one frame is received into a file in
        that directory (Delivery.body_path) instead of memory. `read_early`: such a message is
        read while it is sent, where the transport sends it in chunks (RabbitMQ); only for a queue
        this bus alone consumes, as the reads of two consumers would split its chunks.
        """

    @abstractmethod
    def subscribe(self, pattern: str, handler: EventHandler) -> None:
        """Receive events whose topic matches `pattern` (`*` one word, `#` any)."""

    @abstractmethod
    def request(self, queue: str, body: bytes, *, timeout: float) -> bytes:
        """Publish with a reply address and wait for the reply; raises TimeoutError."""

    def request_large(
        self, queue: str, body: bytes, *, timeout: float, spool: Callable[[], Path]
    ) -> bytes | Path:
        """As `request`, for a reply that may be large: one that comes in chunks (over a frame) is
        written to a new file in the folder `spool()` gives (asked only then) as they arrive, and
        its path returned; the caller deletes it. Memory then holds one chunk, not the reply twice
        (the chunks, and them joined). In memory nothing comes in chunks: always bytes."""
        return self.request(queue, body, timeout=timeout)

    @abstractmethod
    def reply(self, delivery: Delivery, body: Body) -> None:
        """Answer a request delivered to this bus."""

    @abstractmethod
    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` on the dispatch thread after `delay` seconds."""

    @abstractmethod
    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the dispatch thread as soon as it is free. Thread-safe."""

    def call_when_idle(self, callback: Callable[[], None]) -> None:
        """On the dispatch thread (a handler): run `callback` there once the deliveries that have
        already arrived are handled, so that work they share is done once for all of them (a group
        commit). Deliveries held back by prefetch are not waited for."""
        self.call_soon(callback)

    def call_soon_from_signal(self, callback: Callable[[], None]) -> None:
        """As call_soon, safe in a signal handler: queued only (the loop looks within a second)."""
        self.call_soon(callback)

    @abstractmethod
    def run(self) -> None:
        """Dispatch until `stop()`; call from the thread that owns the bus."""

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until consumers and subscriptions made so far are live (after `run()` starts)."""
        return True

    @abstractmethod
    def stop(self) -> None:
        """Make `run()` return; unacked deliveries go back to their queues. Thread-safe."""


def topic_matches(pattern: str, topic: str) -> bool:
    """AMQP topic matching: words split by '.', '*' is one word, '#' zero or more."""
    return _match(pattern.split("."), topic.split("."))


def _match(pat: list[str], words: list[str]) -> bool:
    if not pat:
        return not words
    head, rest = pat[0], pat[1:]
    if head == "#":
        return any(_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head in ("*", words[0])) and _match(rest, words[1:])
