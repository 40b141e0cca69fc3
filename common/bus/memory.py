"""In-memory bus: the same contract as RabbitMQ inside one process.

One `MemoryBroker` holds the queues; each service gets its own `MemoryBus`
(like its own connection) with one dispatch thread. Semantics follow the
broker's: round-robin delivery within prefetch, manual acks, redelivery of
unacked messages when a bus stops, a delivery limit, dead letters with reasons.
Each bus has a user, stamped on everything it publishes as `Delivery.user_id`, as
RabbitMQ stamps (and checks) the broker user; the consumers check it the same way.

A message larger than a frame reaches a consumer with a spool in a file, as it does from
RabbitMQ. (A reply stays in memory, even to request_large: a learner loading the model for each
client it trains reads memory, not the file again.) An encoding whose parts are owned
(Encoded.owned: a learner's update) is kept in its parts until its consumer's thread receives it:
the publisher goes on at once, and the parts are written to the spool file, or joined, there.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import queue
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from fedmq.common.bus.base import Body, Bus, Delivery, EventHandler, Handler, Timer, spool_file, topic_matches
from fedmq.common.codec.pack import Encoded
from fedmq.common.settings import Settings

log = structlog.get_logger(__name__)

REPLY_PREFIX = "reply."
FRAME_BYTES: int = Settings.model_fields["frame_bytes"].default  # larger bodies are spooled


@dataclass
class DeadLetter:
    queue: str
    body: bytes
    reason: str


@dataclass
class _Message:
    body: bytes | Encoded  # an Encoded only when owned: read on the consumer's thread
    reply_to: str | None
    correlation_id: str | None
    headers: dict[str, Any]
    user_id: str | None = None
    deliveries: int = 0


@dataclass(eq=False)
class _Consumer:
    bus: MemoryBus
    handler: Handler
    prefetch: int
    spool: Path | None = None  # where a body over a frame is received (consume's spool)
    unacked: dict[MemoryDelivery, None] = field(default_factory=dict)  # in delivery order


@dataclass
class _Queue:
    ready: deque[_Message] = field(default_factory=deque)
    consumers: list[_Consumer] = field(default_factory=list)
    turn: int = 0


class MemoryBroker:
    """Queues, topic subscriptions and dead letters shared by every MemoryBus."""

    def __init__(self, delivery_limit: int = 20, frame_bytes: int = FRAME_BYTES, fsync: bool = True) -> None:
        """`frame_bytes`, `fsync`: the services' Settings (a body over a frame goes to a consumer's
        spool, fsynced unless FEDMQ_FSYNC=false)."""
        self.delivery_limit = delivery_limit
        self.frame_bytes = frame_bytes
        self.fsync = fsync
        self.dead_letters: list[DeadLetter] = []
        self._lock = threading.RLock()
        self._queues: dict[str, _Queue] = defaultdict(_Queue)
        self._subscriptions: list[tuple[str, MemoryBus, EventHandler]] = []
        self._waiters: dict[str, _Waiter] = {}

    def connect(self, user: str = "guest") -> MemoryBus:
        """A bus publishing as `user` (`guest`, as a RabbitMQ with no definitions, unless told)."""
        return MemoryBus(self, user)

    def depth(self, name: str) -> int:
        """Messages ready plus unacked on a queue."""
        with self._lock:
            q = self._queues[name]
            return len(q.ready) + sum(len(c.unacked) for c in q.consumers)

    def _publish(self, name: str, message: _Message) -> None:
        with self._lock:
            waiter = self._waiters.get(name)
            if waiter is not None:
                waiter.set(_joined(message.body))
                return
            if name.startswith(REPLY_PREFIX):
                return  # a reply nobody waits for any more (timed out): dropped, as RabbitMQ does
            self._queues[name].ready.append(message)
            self._dispatch(name)

    def _publish_event(self, topic: str, body: bytes) -> None:
        with self._lock:
            targets = [(b, h) for p, b, h in self._subscriptions if topic_matches(p, topic)]
        for bus, handler in targets:
            bus.call_soon(functools.partial(handler, body))

    def _dispatch(self, name: str) -> None:
        q = self._queues[name]
        while q.ready:
            consumer = self._next_consumer(q)
            if consumer is None:
                return
            message = q.ready.popleft()
            message.deliveries += 1
            delivery = MemoryDelivery(
                body=message.body if isinstance(message.body, bytes) else b"",  # the rest: MemoryBus._receive
                queue=name,
                redelivered=message.deliveries > 1,
                reply_to=message.reply_to,
                correlation_id=message.correlation_id,
                headers=dict(message.headers),
                user_id=message.user_id,
                _broker=self,
                _consumer=consumer,
                _message=message,
            )
            consumer.unacked[delivery] = None
            consumer.bus.call_soon(functools.partial(consumer.bus._handle, consumer.handler, delivery))

    @staticmethod
    def _next_consumer(q: _Queue) -> _Consumer | None:
        for _ in range(len(q.consumers)):
            consumer = q.consumers[q.turn % len(q.consumers)]
            q.turn += 1
            if len(consumer.unacked) < consumer.prefetch:
                return consumer
        return None

    def _settle(self, delivery: MemoryDelivery, outcome: str, reason: str = "") -> None:
        with self._lock:
            consumer = delivery._consumer
            if delivery not in consumer.unacked:
                return  # already settled, or returned when its bus stopped
            del consumer.unacked[delivery]
            if delivery.body_path is not None:
                delivery.body_path.unlink(missing_ok=True)  # unless the handler moved it away
            if outcome == "reject":
                self.dead_letters.append(DeadLetter(delivery.queue, _joined(delivery._message.body), reason))
                if consumer.bus.on_dead_letter is not None:
                    consumer.bus.on_dead_letter(reason)
            elif outcome == "requeue":
                self._return(delivery.queue, delivery._message)
            self._dispatch(delivery.queue)

    def _return(self, name: str, message: _Message) -> None:
        if message.deliveries >= self.delivery_limit:
            self.dead_letters.append(DeadLetter(name, _joined(message.body), "delivery_limit"))
        else:
            self._queues[name].ready.appendleft(message)

    def _add_consumer(self, name: str, consumer: _Consumer) -> None:
        with self._lock:
            self._queues[name].consumers.append(consumer)
            self._dispatch(name)

    def _detach(self, bus: MemoryBus) -> None:
        """A bus went away: like a closed connection, its unacked messages are redelivered."""
        with self._lock:
            self._subscriptions = [s for s in self._subscriptions if s[1] is not bus]
            for name, q in self._queues.items():
                mine = [c for c in q.consumers if c.bus is bus]
                q.consumers = [c for c in q.consumers if c.bus is not bus]
                for consumer in mine:
                    for delivery in reversed(consumer.unacked):  # back to the head, in their order
                        self._return(name, delivery._message)
                        if delivery.body_path is not None:
                            delivery.body_path.unlink(missing_ok=True)
                    consumer.unacked.clear()
                self._dispatch(name)


@dataclass(eq=False)
class MemoryDelivery(Delivery):
    _broker: MemoryBroker = field(kw_only=True)
    _consumer: _Consumer = field(kw_only=True)
    _message: _Message = field(kw_only=True)

    def ack(self) -> None:
        self._broker._settle(self, "ack")

    def reject(self, reason: str) -> None:
        self._broker._settle(self, "reject", reason)

    def requeue(self) -> None:
        self._broker._settle(self, "requeue")

    def live(self) -> bool:
        with self._broker._lock:
            return self in self._consumer.unacked


class _Waiter:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.body = b""

    def set(self, body: bytes) -> None:
        self.body = body
        self._event.set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


class _MemoryTimer(Timer):
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class MemoryBus(Bus):
    """One service's connection to a MemoryBroker, with its own dispatch thread."""

    def __init__(self, broker: MemoryBroker, user: str = "guest") -> None:
        self.broker = broker
        self.user = user
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, _MemoryTimer, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._idle: list[Callable[[], None]] = []  # call_when_idle's, run when the inbox is empty
        self._running = False
        self._stopped = threading.Event()

    def publish(
        self,
        queue: str,
        body: Body,
        *,
        reply_to: str | None = None,
        correlation_id: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(body, Encoded) and not body.owned:
            body = body.join()  # now: the message is delivered later, its tensors may change before
        if not isinstance(body, bytes | Encoded):
            raise TypeError("message bodies must be bytes")
        self.broker._publish(queue, _Message(body, reply_to, correlation_id, dict(headers or {}), self.user))

    def publish_event(self, topic: str, body: bytes) -> None:
        self.broker._publish_event(topic, body)

    def consume(
        self, queue: str, handler: Handler, *, prefetch: int = 1, spool: Path | None = None,
        read_early: bool = False,
    ) -> None:
        # read_early: nothing comes in chunks here, so nothing is read before it is whole.
        self.broker._add_consumer(queue, _Consumer(self, handler, prefetch, spool))

    def subscribe(self, pattern: str, handler: EventHandler) -> None:
        with self.broker._lock:
            self.broker._subscriptions.append((pattern, self, handler))

    def request(self, queue: str, body: bytes, *, timeout: float) -> bytes:
        address = f"{REPLY_PREFIX}{uuid.uuid4().hex}"
        waiter = _Waiter()
        with self.broker._lock:
            self.broker._waiters[address] = waiter
        try:
            self.publish(queue, body, reply_to=address, correlation_id=address)
            if not waiter.wait(timeout):
                raise TimeoutError(f"no reply from {queue} within {timeout:.1f}s")
            return waiter.body
        finally:
            with self.broker._lock:
                self.broker._waiters.pop(address, None)

    def reply(self, delivery: Delivery, body: Body) -> None:
        if delivery.reply_to:
            self.publish(delivery.reply_to, body, correlation_id=delivery.correlation_id)

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = _MemoryTimer()
        entry = (time.monotonic() + delay, next(self._timer_seq), timer, callback)
        # Timers are only touched on the dispatch thread, so push through the inbox.
        self.call_soon(lambda: heapq.heappush(self._timers, entry))
        return timer

    def call_soon(self, callback: Callable[[], None]) -> None:
        self._inbox.put(callback)

    def call_when_idle(self, callback: Callable[[], None]) -> None:
        self._idle.append(callback)  # on the dispatch thread, which alone reads the list

    def _run_idle(self) -> None:
        while self._idle:
            _guarded(self._idle.pop(0))

    def run(self) -> None:
        self._running = True
        try:
            while self._running:
                timeout = self._fire_due_timers()
                if self._idle and self._inbox.empty():
                    self._run_idle()
                    continue
                try:
                    item = self._inbox.get(timeout=timeout)
                except queue.Empty:
                    continue
                if item is None:
                    break
                _guarded(item)
        finally:
            self._run_idle()  # what was left for later (a group commit) still settles
            self._running = False
            self.broker._detach(self)
            self._stopped.set()

    def stop(self) -> None:
        self._running = False
        self._inbox.put(None)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def _fire_due_timers(self) -> float | None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer, callback = heapq.heappop(self._timers)
            if not timer.cancelled:
                _guarded(callback)
        return max(0.0, self._timers[0][0] - time.monotonic()) if self._timers else None

    def _handle(self, handler: Handler, delivery: MemoryDelivery) -> None:
        try:
            self._receive(delivery)
            handler(delivery)
        except Exception as exc:  # a handler bug must not kill the service: dead-letter
            log.exception("handler_crashed", queue=delivery.queue)
            delivery.reject(f"handler_error: {type(exc).__name__}")


    def _receive(self, delivery: MemoryDelivery) -> None:
        """The body as its consumer gets it, here on the consumer's thread: one over a frame into a
        new file in the consumer's spool, fsynced as RabbitMQ's consumer does it (unless
        FEDMQ_FSYNC=false); else in memory, an owned encoding joined now."""
        body, spool = delivery._message.body, delivery._consumer.spool
        if spool is not None and _size(body) > self.broker.frame_bytes:
            try:
                parts = body.parts if isinstance(body, Encoded) else [body]  # written as they are: no join
                delivery.body_path = spool_file(spool, lambda f: f.writelines(parts), self.broker.fsync)
                delivery.body = b""
                return
            except OSError as exc:  # the consumer's disk: in memory, where its own store says so
                log.warning("spool_unwritable", queue=delivery.queue, error=str(exc)[:300])
        delivery.body = _joined(body)


def _size(body: bytes | Encoded) -> int:
    return body.size if isinstance(body, Encoded) else len(body)


def _joined(body: bytes | Encoded) -> bytes:
    return body.join() if isinstance(body, Encoded) else body


def _guarded(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("timer_callback_crashed")
