"""RabbitMQ bus over pika's BlockingConnection, with the in-memory bus's contract.

One connection and one confirmed channel per bus, owned by the thread in `run()`.
Other threads never touch pika: they queue work on an outbox and wake the loop
with `add_callback_threadsafe`, the one thread-safe pika call (invariant 8).

    publish ──▶ default exchange ──▶ quorum queue ──(reject/limit)──▶ fedmq.dlx ──▶ fedmq.dead
    publish_event ──▶ fedmq.events (topic) ──▶ one exclusive queue per subscription
    request ──▶ queue, reply_to = this bus's exclusive reply queue

A body larger than the frame size travels as a blob: its chunks go to a queue
of their own (`fedmq.blob.<id>`, expiring when unused) and a small envelope that
names it goes to the destination. The receiver reads the chunks while it holds
the envelope and deletes the blob queue once the envelope is settled, so a
crash anywhere leaves either the whole message or nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery, EventHandler, Handler, Timer
from fedmq.common.errors import BrokerUnavailable
from fedmq.common.settings import Settings

log = structlog.get_logger("fedmq.bus")

T = TypeVar("T")

DLX = "fedmq.dlx"
BLOB_PREFIX = "fedmq.blob."
H_BLOB, H_INDEX, H_COUNT, H_SIZE, H_DIGEST = (
    "x-fedmq-blob", "x-fedmq-index", "x-fedmq-count", "x-fedmq-size", "x-fedmq-digest"
)
H_REASON, H_QUEUE = "x-fedmq-reason", "x-fedmq-queue"
BLOB_TTL_MS = 3_600_000

# What means "the connection or channel is gone": reconnect. Anything else a handler raises
# (a full disk, a bug) is that message's problem: it is dead-lettered and the service goes on.
PIKA_ERRORS = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.AMQPChannelError,
    pika.exceptions.StreamLostError,
    pika.exceptions.ConnectionWrongStateError,
    pika.exceptions.ChannelWrongStateError,
)
CONNECTION_ERRORS = (*PIKA_ERRORS, ConnectionError)


class DecodeBlobError(Exception):
    """A chunked message could not be put back together."""


@dataclass(eq=False)
class RabbitDelivery(Delivery):
    _bus: RabbitBus = field(kw_only=True)
    _tag: int = field(kw_only=True)
    _generation: int = field(kw_only=True)
    _blob: str | None = field(default=None, kw_only=True)
    _chunk_tags: list[int] = field(default_factory=list, kw_only=True)
    _settled: bool = field(default=False, kw_only=True)

    def ack(self) -> None:
        self._bus._settle(self, "ack")

    def reject(self, reason: str) -> None:
        self._bus._settle(self, "reject", reason)

    def requeue(self) -> None:
        self._bus._settle(self, "requeue")


class _RabbitTimer(Timer):
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Consumer:
    queue: str
    handler: Handler
    prefetch: int
    spool: Path | None = None


class RabbitBus(Bus):
    """A service's connection to RabbitMQ; `run()` owns it, everything else is thread-safe."""

    def __init__(self, settings: Settings, name: str = "fedmq") -> None:
        self.settings = settings
        self.name = name
        self.params = pika.URLParameters(settings.broker_url)
        self.params.heartbeat = settings.heartbeat_s
        self.params.blocked_connection_timeout = 60
        self.params.connection_attempts = 1
        self.params.socket_timeout = 5
        self.params.client_properties = {"connection_name": name}
        self._consumers: list[_Consumer] = []
        self._subscriptions: list[tuple[str, EventHandler]] = []
        self._outbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, _RabbitTimer, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._waiters: dict[str, Future[bytes]] = {}
        self._conn: BlockingConnection | None = None
        self._ch: BlockingChannel | None = None
        self._blob_ch: BlockingChannel | None = None  # reads chunks; a 404 there spares the main one
        self._reply_queue = ""
        self._generation = 0
        self._thread: int | None = None
        self._running = False
        self._stopped = threading.Event()
        self._ready = threading.Event()  # connected, consumers and subscriptions live
        self._lock = threading.Lock()  # orders registrations against (re)subscription
        self.reconnects = 0
        self.stats = {"published_bytes": 0, "consumed_bytes": 0, "largest_frame_bytes": 0, "blobs_sent": 0}
        self.on_traffic: Callable[[str, int], None] | None = None  # ("published"|"consumed", bytes)

    # -- connection -----------------------------------------------------------

    def connect(self) -> None:
        """Open the connection and declare the topology; BrokerUnavailable if it can't."""
        try:
            self._conn = pika.BlockingConnection(self.params)
            self._ch = self._conn.channel()
            self._ch.confirm_delivery()
            self._ch.add_on_cancel_callback(self._on_cancelled)
            declare_topology(self._ch, self.settings)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._drop()
            if exc.reply_code == 406:
                raise BrokerUnavailable(
                    f"RabbitMQ at {self.settings.safe_broker_url} refused fedmq's queues: {exc.reply_text}. "
                    "They exist with other arguments (FEDMQ_DELIVERY_LIMIT changed?): delete them or "
                    "use a fresh vhost."
                ) from None
            raise BrokerUnavailable(unreachable_message(self.settings, exc)) from None
        except (*CONNECTION_ERRORS, OSError) as exc:
            self._drop()
            raise BrokerUnavailable(unreachable_message(self.settings, exc)) from None
        self._generation += 1

    def _subscribe_all(self) -> None:
        assert self._ch is not None
        ch = self._ch
        result = ch.queue_declare("", exclusive=True, auto_delete=True)
        self._reply_queue = result.method.queue
        ch.basic_qos(prefetch_count=4)
        ch.basic_consume(self._reply_queue, self._on_reply, auto_ack=False)
        with self._lock:
            for consumer in self._consumers:
                self._start_consumer(consumer)
            for pattern, handler in self._subscriptions:
                self._start_subscription(pattern, handler)
            self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def _on_cancelled(self, frame: Any) -> None:
        """The broker cancelled a consumer (queue deleted, leader moved): declare and subscribe again."""
        log.warning("consumer_cancelled_by_broker", bus=self.name)
        self.call_later(self.settings.retry_initial_s, self._resubscribe)

    def _resubscribe(self) -> None:
        # Simplest correct answer: a fresh connection re-declares the topology and every consumer.
        raise pika.exceptions.ChannelWrongStateError("consumer cancelled by broker; resubscribing")

    def _start_consumer(self, consumer: _Consumer) -> None:
        assert self._ch is not None
        self._ch.basic_qos(prefetch_count=consumer.prefetch)
        self._ch.basic_consume(
            consumer.queue,
            lambda ch, method, props, body: self._on_message(consumer, method, props, body),
            auto_ack=False,
        )

    def _start_subscription(self, pattern: str, handler: EventHandler) -> None:
        assert self._ch is not None
        name = self._ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
        self._ch.queue_bind(name, topology.EVENTS, routing_key=pattern)
        self._ch.basic_consume(name, lambda ch, m, p, body: handler(body), auto_ack=True)

    def _drop(self) -> None:
        self._ready.clear()
        # Replies to the old reply queue can never arrive: let waiting requests fail now.
        for future in list(self._waiters.values()):
            if not future.done():
                future.set_exception(ConnectionError("connection to the broker was lost"))
        conn, self._conn, self._ch, self._blob_ch = self._conn, None, None, None
        if conn is not None and conn.is_open:
            # Closing a broken connection may fail in many ways; it is gone either way.
            with contextlib.suppress(Exception):
                conn.close()

    # -- the loop -------------------------------------------------------------

    def run(self) -> None:
        self._thread = threading.get_ident()
        self._running = True
        backoff = self.settings.retry_initial_s
        try:
            while self._running:
                try:
                    if self._conn is None or not self._conn.is_open:
                        self.connect()
                    self._subscribe_all()
                    backoff = self.settings.retry_initial_s
                    self._loop()
                except (BrokerUnavailable, *CONNECTION_ERRORS) as exc:
                    self._drop()
                    if not self._running:
                        break
                    self.reconnects += 1
                    log.warning("broker_connection_lost", bus=self.name, error=str(exc)[:300],
                                retry_in_s=round(backoff, 2))
                    self._pause(backoff)
                    backoff = min(backoff * 2, self.settings.retry_max_s)
        finally:
            self._running = False
            self._drop()
            log.info("bus_stats", bus=self.name, reconnects=self.reconnects,
                     frame_limit_bytes=self.settings.frame_bytes, **self.stats)
            self._stopped.set()

    def _loop(self) -> None:
        assert self._conn is not None
        while self._running:
            self._drain_outbox()
            wait = self._fire_due_timers()
            self._conn.process_data_events(time_limit=min(wait, 1.0) if wait is not None else 1.0)

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self._running and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _drain_outbox(self) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            _guarded(item, "callback_crashed")

    def _fire_due_timers(self) -> float | None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer, callback = heapq.heappop(self._timers)
            if not timer.cancelled:
                _guarded(callback, "timer_callback_crashed")
        return max(0.0, self._timers[0][0] - time.monotonic()) if self._timers else None

    def stop(self) -> None:
        self._running = False
        if not self._on_loop():  # on the loop (a signal handler) the flag is seen within 1 s
            self._wake()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def _wake(self) -> None:
        conn = self._conn
        if conn is not None and conn.is_open:
            # Closing under us: the loop notices by itself.
            with contextlib.suppress(Exception):
                conn.add_callback_threadsafe(lambda: None)

    def _on_loop(self) -> bool:
        return threading.get_ident() == self._thread

    def call_soon(self, callback: Callable[[], None]) -> None:
        self._outbox.put(callback)
        self._wake()

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = _RabbitTimer()
        entry = (time.monotonic() + delay, next(self._seq), timer, callback)
        if self._on_loop():
            heapq.heappush(self._timers, entry)
        else:
            self.call_soon(lambda: heapq.heappush(self._timers, entry))
        return timer

    def _run_on_loop(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run fn on the bus thread (or here, if this is it, or if no loop runs) and return its result."""
        if self._on_loop():
            return fn()
        if not self._running:
            if self._conn is None or not self._conn.is_open:
                self.connect()
            return fn()
        future: Future[T] = Future()

        def work() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

        self.call_soon(work)
        try:
            return future.result(timeout=timeout or self.settings.request_timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"bus {self.name}: broker did not take the message in time") from None

    # -- consuming ------------------------------------------------------------

    def consume(self, queue: str, handler: Handler, *, prefetch: int = 1, spool: Path | None = None) -> None:
        consumer = _Consumer(queue, handler, prefetch, spool)
        self._register(lambda: self._consumers.append(consumer), lambda: self._start_consumer(consumer))

    def subscribe(self, pattern: str, handler: EventHandler) -> None:
        self._register(
            lambda: self._subscriptions.append((pattern, handler)),
            lambda: self._start_subscription(pattern, handler),
        )

    def _register(self, remember: Callable[[], None], start: Callable[[], None]) -> None:
        """Before the bus is ready, remember it for (re)connects; once ready, also start it now."""
        def both() -> None:
            with self._lock:
                remember()
                start()

        if self._on_loop():
            if self._ready.is_set():
                both()
            else:
                remember()
            return
        with self._lock:
            if not self._ready.is_set():
                remember()
                return
        self._run_on_loop(both)

    def _on_message(self, consumer: _Consumer, method: Any, props: Any, body: bytes) -> None:
        self._count_received(len(body))
        headers = dict(props.headers or {})
        delivery = RabbitDelivery(
            body=body,
            queue=consumer.queue,
            redelivered=bool(method.redelivered),
            reply_to=props.reply_to,
            correlation_id=props.correlation_id,
            headers=headers,
            _bus=self,
            _tag=method.delivery_tag,
            _generation=self._generation,
            _blob=headers.get(H_BLOB),
        )
        if delivery._blob is None and len(body) > self.settings.frame_bytes:
            # fedmq never sends one: anything this large comes chunked, checked and bounded.
            log.warning("message_rejected", queue=consumer.queue, reason="oversize", bytes=len(body))
            delivery.reject(f"oversize: {len(body)} bytes over the {self.settings.frame_bytes}-byte frame")
            return
        if delivery._blob is not None:
            try:
                tags = delivery._chunk_tags
                if consumer.spool is not None:
                    delivery.body_path = self._read_blob_to_file(headers, consumer.spool, tags)
                else:
                    delivery.body = self._read_blob(headers, delivery._chunk_tags)
            except DecodeBlobError as exc:
                log.warning("message_rejected", queue=consumer.queue, reason="blob", detail=str(exc))
                delivery.reject(f"blob: {exc}")
                return
        try:
            consumer.handler(delivery)
        except PIKA_ERRORS:
            raise
        except Exception as exc:  # a handler bug must not kill the service: dead-letter
            log.exception("handler_crashed", queue=consumer.queue)
            delivery.reject(f"handler_error: {type(exc).__name__}")

    def _on_reply(self, ch: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
        headers = dict(props.headers or {})
        if H_BLOB in headers:
            try:
                body = self._read_blob(headers, [])
            except DecodeBlobError as exc:
                log.warning("reply_dropped", reason=str(exc))
                body = b""
            finally:
                self._delete_blob(headers[H_BLOB])
        ch.basic_ack(method.delivery_tag)
        future = self._waiters.pop(props.correlation_id or "", None)
        if future is not None and not future.done():
            future.set_result(body)

    def _settle(self, delivery: RabbitDelivery, outcome: str, reason: str = "") -> None:
        if not self._on_loop():
            self.call_soon(lambda: self._settle(delivery, outcome, reason))
            return
        if delivery._settled:
            return
        delivery._settled = True
        if delivery._generation != self._generation or self._ch is None:
            # The connection it came on is gone; the broker has already requeued it.
            log.info("settle_skipped_stale_delivery", queue=delivery.queue, outcome=outcome)
            return
        if outcome == "reject":
            self._dead_letter(delivery, reason)
            self._ch.basic_ack(delivery._tag)
            if self.on_dead_letter is not None:
                self.on_dead_letter(reason)
        elif outcome == "requeue":
            # The chunks we took must go back to their queue before the envelope does.
            if self._blob_ch is not None:
                for tag in delivery._chunk_tags:
                    self._blob_ch.basic_nack(tag, requeue=True)
            self._ch.basic_nack(delivery._tag, requeue=True)
        else:
            self._ch.basic_ack(delivery._tag)
        if delivery._blob is not None and outcome != "requeue":
            self._delete_blob(delivery._blob)
        if delivery.body_path is not None:
            delivery.body_path.unlink(missing_ok=True)

    def _dead_letter(self, delivery: RabbitDelivery, reason: str) -> None:
        assert self._ch is not None
        headers = {**delivery.headers, H_REASON: reason[:1000], H_QUEUE: delivery.queue}
        # A blob's envelope is dead-lettered without its chunks (they expire with their queue).
        body = b"" if delivery._blob is not None else bytes(delivery.body)
        self._ch.basic_publish(
            "", topology.DEAD_LETTERS, body,
            pika.BasicProperties(delivery_mode=2, headers=headers), mandatory=True,
        )

    # -- publishing -----------------------------------------------------------

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        reply_to: str | None = None,
        correlation_id: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(body, bytes):
            raise TypeError("message bodies must be bytes")
        props = pika.BasicProperties(
            delivery_mode=2, reply_to=reply_to, correlation_id=correlation_id, headers=headers or None
        )
        self._run_on_loop(lambda: self._send("", queue, body, props, mandatory=True))

    def publish_event(self, topic: str, body: bytes) -> None:
        props = pika.BasicProperties(delivery_mode=1)
        self._run_on_loop(lambda: self._send(topology.EVENTS, topic, body, props, mandatory=False))

    def reply(self, delivery: Delivery, body: bytes) -> None:
        if not delivery.reply_to:
            return
        props = pika.BasicProperties(delivery_mode=1, correlation_id=delivery.correlation_id)
        # The asker may be gone (timed out, restarted): its reply queue with it. Not an error.
        self._run_on_loop(lambda: self._send("", delivery.reply_to or "", body, props, mandatory=False))

    def request(self, queue: str, body: bytes, *, timeout: float) -> bytes:
        if not self._running:
            raise RuntimeError("request() needs the bus running in another thread")
        correlation_id = uuid.uuid4().hex
        future: Future[bytes] = Future()
        self._waiters[correlation_id] = future
        try:
            self._run_on_loop(lambda: self._send("", queue, body, pika.BasicProperties(
                delivery_mode=2, reply_to=self._reply_queue, correlation_id=correlation_id,
            ), mandatory=True))
            return future.result(timeout=timeout)
        except TimeoutError:
            raise TimeoutError(f"no reply from {queue} within {timeout:.1f}s") from None
        finally:
            self._waiters.pop(correlation_id, None)

    def _send(self, exchange: str, key: str, body: bytes, props: Any, mandatory: bool) -> None:
        """Publish on the loop thread, as a blob when the body is over the frame size."""
        if self._ch is None:
            raise pika.exceptions.ChannelWrongStateError("not connected")
        if len(body) <= self.settings.frame_bytes:
            self._ch.basic_publish(exchange, key, body, props, mandatory=mandatory)
            self._count_sent(len(body))
            return
        self.stats["blobs_sent"] += 1
        blob = f"{BLOB_PREFIX}{uuid.uuid4().hex}"
        frame = self.settings.frame_bytes
        count = -(-len(body) // frame)
        digest = hashlib.sha256(body).hexdigest()
        self._ch.queue_declare(blob, durable=True, arguments={"x-expires": BLOB_TTL_MS})
        view = memoryview(body)
        for index in range(count):
            chunk_headers = {H_BLOB: blob, H_INDEX: index, H_COUNT: count}
            chunk = bytes(view[index * frame : (index + 1) * frame])
            self._ch.basic_publish(
                "", blob, chunk, pika.BasicProperties(delivery_mode=2, headers=chunk_headers), mandatory=True
            )
            self._count_sent(len(chunk))
        envelope_headers = {
            **(props.headers or {}), H_BLOB: blob, H_COUNT: count, H_SIZE: len(body), H_DIGEST: digest
        }
        envelope = pika.BasicProperties(
            delivery_mode=props.delivery_mode, reply_to=props.reply_to,
            correlation_id=props.correlation_id, headers=envelope_headers,
        )
        self._ch.basic_publish(exchange, key, b"", envelope, mandatory=mandatory)

    def _count_sent(self, size: int) -> None:
        self._count("published", size)

    def _count_received(self, size: int) -> None:
        self._count("consumed", size)

    def _count(self, direction: str, size: int) -> None:
        self.stats[f"{direction}_bytes"] += size
        self.stats["largest_frame_bytes"] = max(self.stats["largest_frame_bytes"], size)
        if self.on_traffic is not None:
            self.on_traffic(direction, size)

    def _read_blob(self, headers: dict[str, Any], tags: list[int]) -> bytes:
        """A blob's chunks, in order, in one buffer."""
        buffer = bytearray(self._blob_size(headers))
        offset = 0

        def write(chunk: bytes) -> None:
            nonlocal offset
            buffer[offset : offset + len(chunk)] = chunk
            offset += len(chunk)

        self._collect_blob(headers, write, tags)
        return bytes(buffer)

    def _read_blob_to_file(self, headers: dict[str, Any], spool: Path, tags: list[int]) -> Path:
        """A blob's chunks, in order, written to a new file in `spool`: memory holds one chunk."""
        self._blob_size(headers)
        spool.mkdir(parents=True, exist_ok=True)
        path = spool / f"{uuid.uuid4().hex}.msg"
        try:
            with open(path, "wb") as f:
                self._collect_blob(headers, f.write, tags)
                f.flush()
                os.fsync(f.fileno())  # acked once handled: it must be on disk by then
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path

    def _blob_size(self, headers: dict[str, Any]) -> int:
        blob, count, size = headers.get(H_BLOB), headers.get(H_COUNT), headers.get(H_SIZE)
        if not (isinstance(blob, str) and blob.startswith(BLOB_PREFIX)):
            raise DecodeBlobError(f"bad blob name {blob!r}")
        if not (isinstance(count, int) and isinstance(size, int) and 0 < count <= size):
            raise DecodeBlobError("blob envelope without a valid count and size")
        if size > self.settings.max_message_bytes:
            raise DecodeBlobError(f"{size} bytes is over the {self.settings.max_message_bytes} limit")
        return size

    def _collect_blob(
        self, headers: dict[str, Any], write: Callable[[bytes], object], tags: list[int]
    ) -> None:
        """Read every chunk of a blob in order into `write`, checking order, size and digest."""
        assert self._conn is not None
        if self._blob_ch is None or not self._blob_ch.is_open:
            self._blob_ch = self._conn.channel()
        blob, count, size = headers[H_BLOB], headers[H_COUNT], headers[H_SIZE]
        digest = hashlib.sha256()
        received, deadline = 0, time.monotonic() + self.settings.blob_wait_s
        for index in range(count):
            while True:
                try:
                    method, props, chunk = self._blob_ch.basic_get(blob, auto_ack=False)
                except pika.exceptions.ChannelClosedByBroker as exc:
                    # The blob queue is gone (expired, deleted, never made): only the chunk
                    # channel is lost with it; the envelope is rejected on the main one.
                    self._blob_ch = None
                    raise DecodeBlobError(f"blob queue unavailable: {exc.reply_text}") from None
                if method is not None:
                    tags.append(method.delivery_tag)
                    break
                if time.monotonic() > deadline:
                    raise DecodeBlobError(f"only {index} of {count} chunks arrived")
                self._conn.sleep(0.05)
            got = (props.headers or {}).get(H_INDEX)
            if got != index or received + len(chunk) > size:
                raise DecodeBlobError(f"chunk {got} out of order or oversized (expected {index})")
            self._count_received(len(chunk))
            digest.update(chunk)
            write(chunk)
            received += len(chunk)
        if received != size:
            raise DecodeBlobError(f"blob has {received} bytes, envelope says {size}")
        if digest.hexdigest() != headers.get(H_DIGEST):
            raise DecodeBlobError("digest mismatch")

    def _delete_blob(self, blob: str) -> None:
        """Drop a settled blob's queue (and the chunks we hold from it) on the chunk channel."""
        if self._conn is None or not blob.startswith(BLOB_PREFIX):
            return
        try:
            if self._blob_ch is None or not self._blob_ch.is_open:
                self._blob_ch = self._conn.channel()
            self._blob_ch.queue_delete(blob)
        except pika.exceptions.ChannelClosedByBroker:
            self._blob_ch = None  # already gone: nothing to clean


def _guarded(callback: Callable[[], None], event: str) -> None:
    """Run a callback on the loop; a lost connection propagates (reconnect), a bug is logged."""
    try:
        callback()
    except PIKA_ERRORS:
        raise
    except Exception:
        log.exception(event)


def declare_topology(ch: BlockingChannel, settings: Settings) -> None:
    """Exchanges and queues every service needs; idempotent, run at every (re)connect."""
    ch.exchange_declare(topology.EVENTS, exchange_type="topic", durable=True)
    ch.exchange_declare(DLX, exchange_type="fanout", durable=True)
    ch.queue_declare(topology.DEAD_LETTERS, durable=True, arguments={"x-queue-type": "quorum"})
    ch.queue_bind(topology.DEAD_LETTERS, DLX)
    arguments = {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": DLX,
        "x-delivery-limit": settings.delivery_limit,
    }
    for name in topology.QUEUES:
        ch.queue_declare(name, durable=True, arguments=arguments)


def unreachable_message(settings: Settings, exc: BaseException) -> str:
    detail = str(exc) or "connection refused or timed out"
    return (
        f"cannot reach RabbitMQ at {settings.safe_broker_url} ({detail[:200]}). "
        "Is the broker running (rabbitmq-diagnostics ping), and are FEDMQ_BROKER_URL's "
        "host, port, vhost and credentials right?"
    )
