"""Consuming from RabbitMQ: handlers and subscriptions, started at every connect, and the ack policy.

    message ─▶ over the frame size, not a blob ───────────────────────▶ dead-letter "oversize"
            ─▶ a blob's envelope: read its chunks (size, order, digest) ─✗─▶ dead-letter "blob: ..."
                                  some held by a reader ─▶ back to its queue after HELD_RETRY_S
                                  (read_early: taken from its early read, if whole: early.py)
                                  spool file unwritable (disk full) ─▶ chunks back, read again later,
                                                      the deliveries after it held until then
            ─▶ handler ─▶ ack       gone (and its blob queue deleted)
                       ─▶ reject    to fedmq.dead with the reason (a large body dropped), then acked
                       ─▶ requeue   its chunks back to the blob queue, then itself
                       ─✗ raises    dead-letter "handler_error: <type>"; a pika error reconnects

A delivery is settled once, on the loop thread and on the connection it came
on; one from a connection since lost has already been requeued by the broker.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pika
import pika.exceptions
import structlog

from fedmq.common.bus import topology
from fedmq.common.bus.base import Delivery, EventHandler, Handler
from fedmq.common.bus.blob import H_BLOB, H_SIZE, BlobHeld, BlobReader, DecodeBlobError
from fedmq.common.bus.connection import PIKA_ERRORS, BrokerConnection
from fedmq.common.bus.early import RECOUNT_S, EarlyReads, notice_key

log = structlog.get_logger("fedmq.bus")

H_REASON, H_QUEUE, H_DROPPED = "x-fedmq-reason", "x-fedmq-queue", "x-fedmq-dropped-bytes"
HELD_RETRY_S = 1.0  # an envelope whose chunks a reader holds goes back to its queue after this


@dataclass(eq=False)
class RabbitDelivery(Delivery):
    _consumers: Consumers = field(kw_only=True)
    _tag: int = field(kw_only=True)
    _generation: int = field(kw_only=True)
    _blob: str | None = field(default=None, kw_only=True)
    _chunk_tags: list[int] = field(default_factory=list, kw_only=True)
    _settled: bool = field(default=False, kw_only=True)

    def ack(self) -> None:
        self._consumers._settle(self, "ack")

    def reject(self, reason: str) -> None:
        self._consumers._settle(self, "reject", reason)

    def requeue(self) -> None:
        self._consumers._settle(self, "requeue")

    def live(self) -> bool:
        link = self._consumers._link
        return not self._settled and self._generation == link.generation and not link.is_lost()


# Where an early read of a noticed blob goes (a spool folder, or None: memory; fsynced or not),
# from the notice's properties; None: it is not read early.
NoticeTarget = Callable[[Any], tuple[Path | None, bool] | None]


@dataclass
class _Consumer:
    queue: str
    handler: Handler
    prefetch: int
    spool: Path | None = None
    read_early: bool = False  # its blobs read as they are sent (early.py): this bus alone consumes it
    # While a delivery waits for its spool retry: those that came after it, handed over after it.
    held: deque[RabbitDelivery] | None = None


class Consumers:
    """A bus's consumers and subscriptions: remembered, (re)started on each connection, settled."""

    def __init__(
        self,
        connection: BrokerConnection,
        blobs: BlobReader,
        early: EarlyReads,
        *,
        frame_bytes: int,
        dead_body_bytes: int,
        on_bytes: Callable[[int], None],
        on_dead_letter: Callable[[str], None],
    ) -> None:
        self._link = connection
        self._blobs = blobs
        self._early = early
        # The channel and queue of early-read notices, and the connection (generation) they are on.
        self._notices: tuple[int, Any, str] | None = None
        self._frame_bytes = frame_bytes
        self._dead_body_bytes = dead_body_bytes  # a dead letter's body beyond this is dropped
        self._on_bytes = on_bytes  # every message body received
        self._on_dead_letter = on_dead_letter
        self._consumers: list[_Consumer] = []
        self._subscriptions: list[tuple[str, EventHandler]] = []
        self.ready = threading.Event()  # connected, consumers and subscriptions live
        self._lock = threading.Lock()  # orders registrations against (re)subscription
        self._spool_delay = connection.settings.retry_initial_s  # backoff of reads into a full spool
        # By notice key: where an early read of a blob the notice names goes, (spool folder or None
        # for memory, whether fsynced), or None: not read early.
        self._notice_targets: dict[str, NoticeTarget] = {}

    def consume(
        self, queue: str, handler: Handler, prefetch: int, spool: Path | None, read_early: bool = False
    ) -> None:
        consumer = _Consumer(queue, handler, prefetch, spool, read_early)
        self._register(lambda: self._consumers.append(consumer), lambda: self._start_consumer(consumer))

    def subscribe(self, pattern: str, handler: EventHandler) -> None:
        self._register(
            lambda: self._subscriptions.append((pattern, handler)),
            lambda: self._start_subscription(pattern, handler),
        )

    def start_all(self) -> None:
        """On a fresh connection: start every consumer and subscription made so far; then ready."""
        with self._lock:
            for consumer in self._consumers:
                self._start_consumer(consumer)
            for pattern, handler in self._subscriptions:
                self._start_subscription(pattern, handler)
            self.ready.set()

    def _register(self, remember: Callable[[], None], start: Callable[[], None]) -> None:
        """Before the bus is ready, remember it for (re)connects; once ready, also start it now."""
        def both() -> None:
            with self._lock:
                remember()
                start()

        if self._link.on_loop():
            if self.ready.is_set():
                both()
            else:
                remember()
            return
        with self._lock:
            if not self.ready.is_set():
                remember()
                return
        try:
            self._link.run_on_loop(both)
        except ConnectionError:  # lost before it ran: remember it for the next connect (or run it then)
            self._register(remember, start)

    def _start_consumer(self, consumer: _Consumer) -> None:
        assert self._link.channel is not None
        consumer.held = None  # a new connection: what was held is the broker's again
        if topology.is_site_queue(consumer.queue):  # a learner hosting a site: the scheduler binds it
            topology.declare_site_queue(self._link.channel, self._link.settings, consumer.queue, bind=False)
        self._link.channel.basic_qos(prefetch_count=consumer.prefetch)
        self._link.channel.basic_consume(
            consumer.queue,
            lambda ch, method, props, body: self._on_message(consumer, method, props, body),
            auto_ack=False,
        )
        if consumer.read_early:
            self.hear_notices(consumer.queue, lambda _props: (consumer.spool, True))

    def hear_notices(self, key: str, target: NoticeTarget) -> None:
        """On the loop: start an early read for each notice of a blob sent with routing key `key`,
        where `target(notice's properties)` says. On a channel of its own, so that a broker refusing
        the binding (403) closes that one only; on a new connection, asked for again."""
        conn = self._link.conn
        assert conn is not None
        try:
            if self._notices is None or self._notices[0] != self._link.generation:  # none on this connection
                self._notice_targets.clear()  # the old connection's keys (its reply queue's) are gone
                ch = conn.channel()
                name = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
                ch.basic_consume(name, self._on_notice, auto_ack=True)
                self._notices = (self._link.generation, ch, name)
            _, ch, name = self._notices
            ch.queue_bind(name, topology.BLOBS, routing_key=notice_key(key))
        except pika.exceptions.ChannelClosedByBroker as exc:  # not allowed: its blobs are read as before
            log.warning("early_reads_refused", queue=key, error=exc.reply_text)
            self._notices = None
            return
        self._notice_targets[notice_key(key)] = target

    def _on_notice(self, _ch: Any, method: Any, props: Any, _body: bytes) -> None:
        target = self._notice_targets.get(method.routing_key)
        where = target(props) if target is not None else None
        if where is not None:
            self._early.start(dict(props.headers or {}), *where)

    def _start_subscription(self, pattern: str, handler: EventHandler) -> None:
        ch = self._link.channel
        assert ch is not None
        name = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
        ch.queue_bind(name, topology.EVENTS, routing_key=pattern)
        ch.basic_consume(name, lambda ch, m, p, body: handler(body), auto_ack=True)

    def _on_message(self, consumer: _Consumer, method: Any, props: Any, body: bytes) -> None:
        self._on_bytes(len(body))
        self._link.delivered += 1
        headers = dict(props.headers or {})
        delivery = RabbitDelivery(
            body=body,
            queue=consumer.queue,
            redelivered=bool(method.redelivered),
            reply_to=props.reply_to,
            correlation_id=props.correlation_id,
            headers=headers,
            user_id=props.user_id,
            _consumers=self,
            _tag=method.delivery_tag,
            _generation=self._link.generation,
            _blob=headers.get(H_BLOB),
        )
        if delivery._blob is None and len(body) > self._frame_bytes:
            # fedmq never sends one: anything this large comes chunked, checked and bounded.
            log.warning("message_rejected", queue=consumer.queue, reason="oversize", bytes=len(body))
            delivery.reject(f"oversize: {len(body)} bytes over the {self._frame_bytes}-byte frame")
            return
        if consumer.held is not None:  # one before it waits for its spool retry: in order, behind it
            consumer.held.append(delivery)
            return
        self._deliver(consumer, delivery)

    def _deliver(self, consumer: _Consumer, delivery: RabbitDelivery) -> None:
        """Read a blob's body if it has one, then hand the delivery to the consumer's handler."""
        if delivery._settled or delivery._generation != self._link.generation:
            return  # a spool retry for a delivery the broker has taken back with its connection
        if delivery._blob is not None:
            try:
                body = self.read_blob(delivery.headers, consumer.spool, delivery._chunk_tags, sync=True,
                                      early=consumer.read_early)
                if isinstance(body, Path):
                    delivery.body_path = body
                else:  # from an early read a bytearray, filled as the chunks came: read like bytes,
                    delivery.body = cast(bytes, body)  # never joined (a tenth of a second at 200 MB)
            except BlobHeld as exc:  # back in its queue after a moment: counted by the delivery limit
                log.info("blob_held", queue=consumer.queue, detail=str(exc))
                self._link.call_later(HELD_RETRY_S, lambda: delivery.requeue() if delivery.live() else None)
                return
            except DecodeBlobError as exc:
                log.warning("message_rejected", queue=consumer.queue, reason="blob", detail=str(exc))
                delivery.reject(f"blob: {exc}")
                return
            except OSError as exc:  # the spool file could not be written (disk full): wait, then again
                self._spool_failed(consumer, delivery, exc)
                return
            self._spool_delay = self._link.settings.retry_initial_s
        try:
            consumer.handler(delivery)
        except PIKA_ERRORS:
            raise
        except Exception as exc:  # a handler bug must not kill the service: dead-letter
            if self._link.is_lost():  # pika's error from a dead connection, whatever its type
                raise ConnectionError(f"connection lost in the {consumer.queue} handler: {exc!r}") from exc
            log.exception("handler_crashed", queue=consumer.queue)
            delivery.reject(f"handler_error: {type(exc).__name__}")

    def read_blob(
        self, headers: dict[str, Any], spool: Path | None, tags: list[int], *, sync: bool, early: bool
    ) -> bytes | bytearray | Path:
        """On the loop: a blob's body, taken from its early read when that is whole (`early`), else
        read from its queue (the chunks taken added to `tags`); into a new file in `spool`, or memory.
        BlobHeld, DecodeBlobError, OSError: as BlobReader says."""
        body, begun = self._early.claim(headers) if early else (None, False)
        if body is not None:
            self._on_bytes(int(headers[H_SIZE]))
            return body
        patience_s = RECOUNT_S if begun else 0.0  # chunks just given back may take a moment to count
        if spool is None:
            return self._blobs.read(headers, tags, patience_s=patience_s)
        return self._blobs.read_to_file(headers, spool, tags, sync=sync, patience_s=patience_s)

    def _spool_failed(self, consumer: _Consumer, delivery: RabbitDelivery, exc: OSError) -> None:
        """Chunks back to their queue, the envelope kept unacked (the queue waits), read again later."""
        self._blobs.requeue(delivery._chunk_tags)
        delivery._chunk_tags.clear()
        log.error("state_unwritable", path=str(exc.filename or consumer.spool), errno=exc.errno,
                  error=exc.strerror or str(exc), retry_in_s=round(self._spool_delay, 2))
        if consumer.held is None:
            consumer.held = deque()
        self._link.call_later(self._spool_delay, lambda: self._retry_spool(consumer, delivery))
        cap = max(self._link.settings.state_retry_max_s, self._link.settings.retry_initial_s)
        self._spool_delay = min(self._spool_delay * 2, cap)

    def _retry_spool(self, consumer: _Consumer, delivery: RabbitDelivery) -> None:
        """The delivery again, then those held behind it, in order, until one fails again."""
        if not delivery.live():
            return  # taken back with its connection (a new one has started the consumer afresh)
        held, consumer.held = consumer.held or deque(), None
        self._deliver(consumer, delivery)
        while held:
            if consumer.held is not None:  # it failed again: the rest stay behind it
                consumer.held.extend(held)
                return
            self._deliver(consumer, held.popleft())

    def _settle(self, delivery: RabbitDelivery, outcome: str, reason: str = "") -> None:
        if not self._link.on_loop():
            self._link.call_soon(lambda: self._settle(delivery, outcome, reason))
            return
        if delivery._settled:
            return
        delivery._settled = True
        ch = self._link.channel
        if delivery._generation != self._link.generation or ch is None:
            # The connection it came on is gone; the broker has already requeued it, to be read anew.
            log.info("settle_skipped_stale_delivery", queue=delivery.queue, outcome=outcome)
            if delivery.body_path is not None:
                delivery.body_path.unlink(missing_ok=True)
            return
        if outcome == "reject":
            self._dead_letter(delivery, reason)
            ch.basic_ack(delivery._tag)
            self._on_dead_letter(reason)
        elif outcome == "requeue":
            # The chunks we took must go back to their queue before the envelope does.
            self._blobs.requeue(delivery._chunk_tags)
            if delivery._blob is not None:
                self._early.release(delivery._blob)
            ch.basic_nack(delivery._tag, requeue=True)
        else:
            ch.basic_ack(delivery._tag)
        try:
            if delivery._blob is not None and outcome != "requeue":
                try:
                    self._blobs.delete(delivery._blob)
                finally:  # even when the connection went meanwhile: the read must not hold its chunks
                    self._early.forget(delivery._blob)
        finally:
            if delivery.body_path is not None:
                delivery.body_path.unlink(missing_ok=True)

    def _dead_letter(self, delivery: RabbitDelivery, reason: str) -> None:
        assert self._link.channel is not None
        headers = {**delivery.headers, H_REASON: reason[:1000], H_QUEUE: delivery.queue}
        # A blob's envelope is dead-lettered without its chunks (they expire with their queue).
        body = b"" if delivery._blob is not None else bytes(delivery.body)
        if len(body) > self._dead_body_bytes:  # the reason stays; a hostile body need not
            headers[H_DROPPED] = len(body)
            body = b""
        self._link.channel.basic_publish(  # through the DLX: nobody writes to the default exchange
            topology.DLX, topology.DEAD_LETTERS, body,
            pika.BasicProperties(delivery_mode=2, headers=headers, user_id=self._link.user or None),
            mandatory=True,
        )
