"""RabbitMQ bus over pika's BlockingConnection, with the in-memory bus's contract.

Publishing waits for the broker's confirm; a body over the frame size goes as a
blob, cut from its encoded parts (codec.Encoded) without joining them. Requests
wait for a reply on this bus's exclusive reply queue, bound to fedmq.x.reply. Every
message goes through a named exchange (topology.py) and carries this connection's broker
user in `user_id`, which RabbitMQ checks. The parts:

    connection.py   the connection, its loop thread, timers, reconnects, the hand-off
    consumers.py    consumers and subscriptions, and settling (ack, reject, requeue)
    blob.py         messages larger than one frame, as chunks on a queue of their own
    early.py        reading those chunks while they are sent, for a queue this bus alone consumes
    topology.py     the queues and exchanges, declared at every connect
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from fedmq.common.bus import topology
from fedmq.common.bus.base import Body, Bus, Delivery, EventHandler, Handler, Timer
from fedmq.common.bus.batch import BatchPublisher
from fedmq.common.bus.blob import (
    H_BLOB,
    BlobHeld,
    BlobIncomplete,
    BlobReader,
    BlobWriter,
    DecodeBlobError,
)
from fedmq.common.bus.connection import BrokerConnection, connection_parameters
from fedmq.common.bus.consumers import Consumers
from fedmq.common.bus.early import EarlyReads, notice_key
from fedmq.common.codec.pack import Encoded
from fedmq.common.settings import Settings

log = structlog.get_logger("fedmq.bus")


class RabbitBus(Bus):
    """A service's connection to RabbitMQ; `run()` owns it, everything else is thread-safe."""

    def __init__(self, settings: Settings, name: str = "fedmq") -> None:
        self.settings = settings
        self.name = name
        self._link = BrokerConnection(settings, name, on_open=self._on_open, on_lost=self._on_lost)
        self._blobs = BlobReader(
            lambda: self._link.conn,
            max_bytes=settings.max_message_bytes, on_chunk=self._count_received,
        )
        self._writer = BlobWriter(
            lambda: self._link.conn, frame_bytes=settings.frame_bytes, expiry_s=settings.blob_expiry_s,
            commit_bytes=settings.blob_commit_bytes,
        )
        self._batches = BatchPublisher(lambda: self._link.conn)
        self._events: BlockingChannel | None = None  # publish_event's channel, unconfirmed
        self._early = EarlyReads(self._early_node, max_bytes=settings.max_message_bytes, name=name)
        self._consumers = Consumers(
            self._link, self._blobs, self._early, frame_bytes=settings.frame_bytes,
            dead_body_bytes=settings.dead_letter_body_bytes,
            on_bytes=self._count_received, on_dead_letter=self._dead_lettered,
        )
        self._waiters: dict[str, Future[bytes | Path]] = {}
        self._spools: dict[str, Callable[[], Path]] = {}  # by correlation id: where a large reply goes
        self._orphans: list[str] = []  # blob queues of failed sends, deleted at the next connect
        self._sites_bound: set[str] = set()  # site queues declared and bound on this connection
        self._reply_queue = ""
        self._stopped = threading.Event()
        self.stats = {"published_bytes": 0, "consumed_bytes": 0, "largest_frame_bytes": 0, "blobs_sent": 0}
        self.on_traffic: Callable[[str, int], None] | None = None  # ("published"|"consumed", bytes)

    @property
    def reconnects(self) -> int:
        return self._link.reconnects

    @property
    def blobs_read_early(self) -> int:
        """Large messages handed over from a read begun while they were sent (early.py)."""
        return self._early.handed

    @property
    def node(self) -> int:
        """Which of the broker addresses the connection is on (or was last on)."""
        return self._link.node

    # -- the connection and its thread ----------------------------------------

    def connect(self) -> None:
        """Open the connection and declare the topology; BrokerUnavailable if it can't."""
        self._link.connect()

    def run(self) -> None:
        try:
            self._link.run()
        finally:
            self._early.stop()
            log.info("bus_stats", bus=self.name, reconnects=self.reconnects,
                     frame_limit_bytes=self.settings.frame_bytes, blobs_read_early=self.blobs_read_early,
                     **self.stats)
            self._stopped.set()

    def stop(self) -> None:
        self._link.stop()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._consumers.ready.wait(timeout)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def call_soon(self, callback: Callable[[], None]) -> None:
        self._link.call_soon(callback)

    def call_soon_from_signal(self, callback: Callable[[], None]) -> None:
        self._link.call_soon_quietly(callback)

    def call_when_idle(self, callback: Callable[[], None]) -> None:
        self._link.call_when_idle(callback)

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self._link.call_later(delay, callback)

    def _on_open(self) -> None:
        """On every (re)connect: orphans deleted, a fresh reply queue, every consumer and subscription."""
        ch = self._link.channel
        assert ch is not None
        self._sites_bound.clear()  # a fresh connection declares (and binds) them again
        while self._orphans:
            ch.queue_delete(self._orphans[-1])  # idempotent: one already gone is no error
            self._orphans.pop()
        self._reply_queue = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
        ch.queue_bind(self._reply_queue, topology.REPLIES, routing_key=self._reply_queue)
        ch.basic_qos(prefetch_count=4)
        ch.basic_consume(self._reply_queue, self._on_reply, auto_ack=False)
        # A large reply is read while it is sent: this bus alone reads its reply queue.
        self._consumers.hear_notices(self._reply_queue, self._reply_target)
        self._consumers.start_all()

    def _on_lost(self) -> None:
        self._consumers.ready.clear()
        # Their envelopes come again, on the next connection, and are read anew.
        self._early.release_claimed()
        # Replies to the old reply queue can never arrive: let waiting requests fail now.
        for future in list(self._waiters.values()):
            with contextlib.suppress(InvalidStateError):  # one its request just gave up on
                future.set_exception(ConnectionError("connection to the broker was lost"))
        self._blobs.forget()
        self._writer.forget()
        self._batches.forget()
        self._events = None

    # -- consuming ------------------------------------------------------------

    def consume(
        self, queue: str, handler: Handler, *, prefetch: int = 1, spool: Path | None = None,
        read_early: bool = False,
    ) -> None:
        self._consumers.consume(queue, handler, prefetch, spool, read_early)

    def _early_node(self) -> pika.ConnectionParameters | None:
        """Early reads' connection: to the node the bus is on, named for the broker's UI."""
        if self._link.conn is None:
            return None
        return connection_parameters(self.settings, f"{self.name}-early")[self._link.node]

    def subscribe(self, pattern: str, handler: EventHandler) -> None:
        self._consumers.subscribe(pattern, handler)

    def _dead_lettered(self, reason: str) -> None:
        if self.on_dead_letter is not None:
            self.on_dead_letter(reason)

    # -- publishing -----------------------------------------------------------

    def publish(
        self,
        queue: str,
        body: Body,
        *,
        reply_to: str | None = None,
        correlation_id: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(body, bytes | Encoded):
            raise TypeError("message bodies must be bytes (or codec.Encoded)")
        exchange = topology.exchange_for(queue)
        props = self._props(
            delivery_mode=2, reply_to=reply_to, correlation_id=correlation_id, headers=headers
        )

        def send() -> None:
            if exchange == topology.SITES:
                self._ensure_site_queue(queue)
            self._send(exchange, queue, body, props, mandatory=True)

        self._link.run_on_loop(send)

    def publish_all(self, messages: Sequence[tuple[str, bytes]]) -> None:
        """In one transaction (batch.py): the broker's one wait for them all, not one each."""
        if len(messages) < 2 or any(len(body) > self.settings.frame_bytes for _, body in messages):
            super().publish_all(messages)  # a blob goes on its own
            return
        props = self._props(delivery_mode=2)
        routed = [(topology.exchange_for(queue), queue, body) for queue, body in messages]

        def send() -> None:
            for exchange, queue, _ in routed:
                if exchange == topology.SITES:
                    self._ensure_site_queue(queue)
            self._batches.publish(routed, props)
            for _, _, body in routed:
                self._count_sent(len(body))

        self._link.run_on_loop(send)

    def _ensure_site_queue(self, queue: str) -> None:
        """A site's queue exists and is bound before its first task on this connection (the
        scheduler's right): a task for a site whose learner is down waits there, not unroutable."""
        if queue in self._sites_bound:
            return
        ch = self._link.channel
        if ch is None:
            raise pika.exceptions.ChannelWrongStateError("not connected")
        topology.declare_site_queue(ch, self.settings, queue, bind=True)
        self._sites_bound.add(queue)

    def publish_event(self, topic: str, body: bytes) -> None:
        """On a channel without confirms: an event is best effort, so nothing waits for the broker
        (the confirmed channel would wait about a millisecond for each)."""
        props = self._props(delivery_mode=1)

        def send() -> None:
            if len(body) > self.settings.frame_bytes:  # as a blob, confirmed like any other
                self._send(topology.EVENTS, topic, body, props, mandatory=False)
                return
            self._event_channel().basic_publish(topology.EVENTS, topic, body, props)
            self._count_sent(len(body))

        self._link.run_on_loop(send)

    def _event_channel(self) -> BlockingChannel:
        if self._events is None or not self._events.is_open:
            conn = self._link.conn
            if conn is None:
                raise pika.exceptions.ChannelWrongStateError("not connected")
            self._events = conn.channel()
        return self._events

    def _props(
        self, *, delivery_mode: int, reply_to: str | None = None, correlation_id: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> pika.BasicProperties:
        """Message properties naming this connection's user: RabbitMQ refuses a publish with another."""
        return pika.BasicProperties(
            delivery_mode=delivery_mode, reply_to=reply_to, correlation_id=correlation_id,
            headers=headers or None, user_id=self._link.user or None,
        )

    def reply(self, delivery: Delivery, body: Body) -> None:
        if not delivery.reply_to:
            return
        props = self._props(delivery_mode=1, correlation_id=delivery.correlation_id)
        queue = delivery.reply_to or ""
        try:  # mandatory: a large reply's blob queue is deleted when its envelope cannot be routed
            self._link.run_on_loop(lambda: self._send(topology.REPLIES, queue, body, props, mandatory=True))
        except pika.exceptions.UnroutableError:
            # The asker is gone (timed out, restarted, cut off), its reply queue with it. Not an error.
            log.info("reply_undeliverable", queue=delivery.queue)
        except BlobIncomplete as exc:  # the broker lost chunks of a large reply: the asker asks again
            log.warning("reply_not_sent", queue=delivery.queue, error=str(exc))

    def request(self, queue: str, body: bytes, *, timeout: float) -> bytes:
        reply = self._request(queue, body, timeout, None)
        assert isinstance(reply, bytes)
        return reply

    def request_large(
        self, queue: str, body: bytes, *, timeout: float, spool: Callable[[], Path]
    ) -> bytes | Path:
        return self._request(queue, body, timeout, spool)

    def _request(
        self, queue: str, body: bytes, timeout: float, spool: Callable[[], Path] | None
    ) -> bytes | Path:
        if not self._link.running:
            raise RuntimeError("request() needs the bus running in another thread")
        correlation_id = uuid.uuid4().hex
        exchange = topology.exchange_for(queue)
        future: Future[bytes | Path] = Future()
        self._waiters[correlation_id] = future
        if spool is not None:
            self._spools[correlation_id] = spool
        try:
            self._link.run_on_loop(lambda: self._send(exchange, queue, body, self._props(
                delivery_mode=2, reply_to=self._reply_queue, correlation_id=correlation_id,
            ), mandatory=True))
            return future.result(timeout=timeout)
        except TimeoutError:
            # A reply coming now finds the future cancelled and deletes its own file; one that came
            # just before is this side's to delete.
            if not future.cancel() and future.exception() is None:
                late = future.result()
                if isinstance(late, Path):
                    late.unlink(missing_ok=True)
            raise TimeoutError(f"no reply from {queue} within {timeout:.1f}s") from None
        finally:
            self._waiters.pop(correlation_id, None)
            self._spools.pop(correlation_id, None)

    def _send(self, exchange: str, key: str, body: Body, props: Any, mandatory: bool) -> None:
        """Publish on the loop thread, as a blob when the body is over the frame size."""
        ch = self._link.channel
        if ch is None:
            raise pika.exceptions.ChannelWrongStateError("not connected")
        encoded = body if isinstance(body, Encoded) else Encoded([body])
        if encoded.size <= self.settings.frame_bytes:
            ch.basic_publish(exchange, key, encoded.join(), props, mandatory=mandatory)
            self._count_sent(encoded.size)
            return
        self.stats["blobs_sent"] += 1
        self._writer.publish(ch, exchange, key, encoded, props, mandatory=mandatory, notice=notice_key(key),
                             on_chunk=self._count_sent, on_orphan=self._orphans.append)

    def _reply_target(self, notice: Any) -> tuple[Path | None, bool] | None:
        """Where a large reply's early read goes: the folder its request asked for, or memory; None
        when no request waits for it."""
        asked = notice.correlation_id or ""
        if asked not in self._waiters:
            return None
        spool = self._spools.get(asked)
        return (spool() if spool is not None else None), False

    def _on_reply(self, ch: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
        headers = dict(props.headers or {})
        reply: bytes | Path = body
        failed: OSError | None = None
        if H_BLOB in headers:
            spool = self._spools.get(props.correlation_id or "")
            folder = spool() if spool is not None else None
            try:
                got = self._consumers.read_blob(headers, folder, [], sync=False, early=True)
                reply = bytes(got) if isinstance(got, bytearray) else got  # request() returns bytes
            except BlobHeld as exc:  # chunks still held (a slow release): the asker asks again
                log.warning("reply_dropped", reason=str(exc))
                failed = ConnectionError(f"a large reply's chunks were held: {exc}")
            except DecodeBlobError as exc:
                log.warning("reply_dropped", reason=str(exc))
                reply = b""
            except OSError as exc:  # its file could not be written (a full disk): this side's trouble
                log.warning("reply_dropped", reason=f"{type(exc).__name__}: {exc}")
                failed = exc
            finally:
                try:
                    self._blobs.delete(headers[H_BLOB])
                except BaseException:  # the connection went: this reply is nobody's now
                    if isinstance(reply, Path):
                        reply.unlink(missing_ok=True)
                    raise
                finally:  # even then: the read must not hold its chunks
                    self._early.forget(headers[H_BLOB])
        ch.basic_ack(method.delivery_tag)
        future = self._waiters.pop(props.correlation_id or "", None)
        try:
            if future is None:
                raise InvalidStateError("nobody waits for this reply")
            if failed is not None:
                future.set_exception(failed)
            else:
                future.set_result(reply)
        except InvalidStateError:  # its request gave up waiting (cancelled): nobody will delete it
            if isinstance(reply, Path):
                reply.unlink(missing_ok=True)

    # -- traffic --------------------------------------------------------------

    def _count_sent(self, size: int) -> None:
        self._count("published", size)

    def _count_received(self, size: int) -> None:
        self._count("consumed", size)

    def _count(self, direction: str, size: int) -> None:
        self.stats[f"{direction}_bytes"] += size
        self.stats["largest_frame_bytes"] = max(self.stats["largest_frame_bytes"], size)
        if self.on_traffic is not None:
            self.on_traffic(direction, size)
