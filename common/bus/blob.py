"""The chunked-blob protocol: a message larger than one frame, sent and read back over RabbitMQ.

    sender ──notice (blob, count, size; a hint: early.py)──▶ fedmq.x.blob, key fedmq.early.<key>
           ──chunks 0..n-1, mandatory, committed in transactions──▶ fedmq.x.blob ──▶ [fedmq.blob.<id>]
                                                              (x-expires: FEDMQ_BLOB_EXPIRY_S unused)
           ──envelope (empty body; names the blob, count, size, sha256)──▶ destination queue
           ✗ failed before the envelope left, or the broker refused it ──▶ queue_delete (now,
             or on the next connection if this one is gone)
    receiver, holding the envelope ──passive declare: n chunks there? ─✗─▶ refused at once
                                   ──basic_get, in order──▶ checked body ──▶ handler
             envelope settled ──▶ queue_delete fedmq.blob.<id>

The sender cuts the chunks from the message's encoded parts (codec.Encoded), so it never
holds the whole message in one buffer. The chunks go to a queue of their own
(`fedmq.blob.<id>`, expiring when unused) and a small envelope that names it goes to the
destination. The receiver reads
the chunks while it holds the envelope and deletes the blob queue once the
envelope is settled, so a crash anywhere leaves either the whole message or nothing.
A sender that fails deletes its blob queue unless the envelope may have reached its
queue; a sender that dies leaves it to expire, unused, after FEDMQ_BLOB_EXPIRY_S.

A receiver's bus reads nothing before the envelope comes, except an early read (early.py): a
consumer that alone consumes its queue may take the chunks as they are sent, on a thread of its
own, after the notice the sender publishes first. Nothing on the bus's thread waits for a chunk.

Every chunk is committed (enqueued and persisted, as a confirm
says), mandatory and none returned, before the envelope is sent, so
when an envelope arrives its blob queue already holds all of them: a passive declare
counts them, and an envelope whose chunks are not all there is refused before any is
read, whatever it claims. A receiver that gives an envelope back first gives back its
chunks, on the channel its next passive declare goes through, so the broker has them
back before it counts them again.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from fedmq.common.bus.base import spool_file
from fedmq.common.bus.topology import BLOBS
from fedmq.common.codec.pack import Encoded

BLOB_PREFIX = "fedmq.blob."
H_BLOB, H_INDEX, H_COUNT, H_SIZE, H_DIGEST = (
    "x-fedmq-blob", "x-fedmq-index", "x-fedmq-count", "x-fedmq-size", "x-fedmq-digest"
)


# Chunks sent per transaction. The broker keeps a transaction's messages in memory until its
# commit: 16 MiB a sending learner, so that many learners sending at once do not trip its memory
# alarm (which blocks every publisher, the control plane's too).
COMMIT_BYTES = 16 * 1024 * 1024


class DecodeBlobError(Exception):
    """A chunked message could not be put back together."""


class BlobHeld(DecodeBlobError):
    """Not every chunk is in the blob queue, but a reader holds some (an early read giving them
    back, or another's): whole later, perhaps, so the envelope is tried again, not refused."""


class BlobIncomplete(Exception):
    """After its commits, a blob queue did not hold every chunk: no envelope was sent."""


class BlobWriter:
    """Sends blobs: chunks in transactions on a channel of its own, the envelope on the bus's channel.

    Why transactions: a confirmed channel makes each chunk wait for the broker to persist it
    before the next is sent; a transaction sends COMMIT_BYTES of chunks back to back and waits
    once, and its commit-ok says they are all enqueued and persisted, as confirms would.
    """

    def __init__(self, connection: Callable[[], BlockingConnection | None], *, frame_bytes: int,
                 expiry_s: int, commit_bytes: int = COMMIT_BYTES) -> None:
        self._connection = connection  # the bus's current connection, None while it has none
        self._frame_bytes = frame_bytes
        self._expiry_s = expiry_s
        self._commit_bytes = commit_bytes
        self._ch: BlockingChannel | None = None
        self._returned = 0  # chunks of the blob being sent that the broker returned (no queue)

    def forget(self) -> None:
        """The connection is gone, and its chunk channel with it."""
        self._ch = None

    def publish(
        self,
        ch: BlockingChannel,
        exchange: str,
        key: str,
        body: Encoded,
        props: pika.BasicProperties,
        *,
        mandatory: bool,
        on_chunk: Callable[[int], None],
        on_orphan: Callable[[str], None],
        notice: str | None = None,
    ) -> None:
        """Send `body` as chunks of at most the frame size on a blob queue, then the envelope naming it;
        first a notice naming the blob on fedmq.x.blob with the key `notice` (early.py), if given.

        If it fails where no envelope can name the blob, the blob queue is deleted, or handed to
        `on_orphan` when this channel can no longer do it.
        """
        blob = f"{BLOB_PREFIX}{uuid.uuid4().hex}"
        count = -(-body.size // self._frame_bytes)
        ch.queue_declare(blob, durable=True, arguments={"x-expires": self._expiry_s * 1000})
        try:
            ch.queue_bind(blob, BLOBS, routing_key=blob)  # nobody writes to the default exchange
            if notice is not None:  # a hint, routed or not: an early reader takes the chunks as they come
                told = pika.BasicProperties(headers={H_BLOB: blob, H_COUNT: count, H_SIZE: body.size},
                                            correlation_id=props.correlation_id, user_id=props.user_id)
                ch.basic_publish(BLOBS, notice, b"", told)
            digest = self._send_chunks(blob, body, count, props.user_id, on_chunk)
        except BaseException:
            _discard(ch, blob, on_orphan)  # no envelope was sent: nobody will ever read these chunks
            raise
        envelope_headers = {
            **(props.headers or {}), H_BLOB: blob, H_COUNT: count, H_SIZE: body.size, H_DIGEST: digest
        }
        envelope = pika.BasicProperties(
            delivery_mode=props.delivery_mode, reply_to=props.reply_to,
            correlation_id=props.correlation_id, headers=envelope_headers, user_id=props.user_id,
        )
        try:
            ch.basic_publish(exchange, key, b"", envelope, mandatory=mandatory)
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError):
            _discard(ch, blob, on_orphan)  # the broker refused the envelope: nothing names the blob
            raise
        # Lost before its confirm, the envelope may be in its queue: the blob stays (and expires).

    def _send_chunks(
        self, blob: str, body: Encoded, count: int, user_id: str | None, on_chunk: Callable[[int], None]
    ) -> str:
        """Publish and commit every chunk, check the blob queue took them all; their sha256."""
        tx = self._channel()
        digest = hashlib.sha256()
        pending = 0  # bytes published since the last commit
        self._returned = 0
        try:
            with InOrder() as hashing:  # each chunk hashed while it is sent
                for index, chunk in enumerate(_chunks(body.parts, self._frame_bytes)):
                    headers = {H_BLOB: blob, H_INDEX: index, H_COUNT: count}
                    chunk_props = pika.BasicProperties(delivery_mode=2, headers=headers, user_id=user_id)
                    hashing.do(digest.update, chunk)
                    tx.basic_publish(BLOBS, blob, chunk, chunk_props, mandatory=True)
                    on_chunk(len(chunk))
                    pending += len(chunk)
                    if pending >= self._commit_bytes:
                        tx.tx_commit()
                        pending = 0
                tx.tx_commit()
                hashing.wait()
        except BaseException:
            if tx.is_open:  # no half-sent chunks left for the next blob's commit to send
                tx.tx_rollback()
            raise
        # So that no envelope ever names a blob that lacks a chunk: none came back unroutable (a
        # return comes before its commit's answer), and the queue is still there. Not a count of
        # the chunks it holds: an early reader (early.py) may hold some already, unacked.
        if self._returned:
            raise BlobIncomplete(f"blob {blob}: {self._returned} of its {count} chunks found no queue")
        try:
            tx.queue_declare(blob, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._ch = None
            raise BlobIncomplete(f"blob {blob} is gone after its commits: {exc.reply_text}") from None
        return digest.hexdigest()

    def _on_return(self, *_returned: object) -> None:
        self._returned += 1

    def _channel(self) -> BlockingChannel:
        if self._ch is None or not self._ch.is_open:
            conn = self._connection()
            if conn is None:
                raise pika.exceptions.ChannelWrongStateError("not connected")
            self._ch = conn.channel()
            self._ch.tx_select()
            # Returns come before commit-ok, on the underlying channel at once (batch.py says why).
            self._ch._impl.add_on_return_callback(self._on_return)
        return self._ch


class InOrder:
    """Calls run in order on one other thread, at most AHEAD behind the caller's: a chunk is hashed
    (and written) while the next one crosses to or from the broker (hashlib and file writes let go
    of the GIL; SHA-256 of 200 MB takes 0.14-0.8 s, as long as a good part of the transfer). A
    call's error is raised by the caller's next `do` or `wait`; leaving the block waits for the
    calls begun and drops the others."""

    AHEAD = 4  # chunks held for the thread at most (4 MiB each by default)

    def __enter__(self) -> InOrder:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="blob-chunks")
        self._pending: deque[Future[object]] = deque()
        return self

    def do(self, call: Callable[[bytes], object], chunk: bytes) -> None:
        self._pending.append(self._pool.submit(call, chunk))
        while len(self._pending) > self.AHEAD:
            self._pending.popleft().result()

    def wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def __exit__(self, *exc: object) -> None:
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True)


def _chunks(parts: list[bytes | memoryview], size: int) -> Iterator[bytes]:
    """The parts' bytes, in order, cut into chunks of `size` (the last one shorter): one copy each."""
    pending: list[memoryview] = []
    filled = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            take = min(size - filled, view.nbytes)
            pending.append(view[:take])
            filled += take
            view = view[take:]
            if filled == size:
                yield b"".join(pending)
                pending, filled = [], 0
    if filled:
        yield b"".join(pending)


def _discard(ch: BlockingChannel, blob: str, on_orphan: Callable[[str], None]) -> None:
    """Delete a blob queue nothing will read; best effort, else later, on another connection."""
    if ch.is_open:
        try:
            ch.queue_delete(blob)
            return
        except Exception:  # the channel or connection is going: the next one deletes it
            pass
    on_orphan(blob)


class BlobReader:
    """Reads blobs on a channel of its own: a missing blob queue closes that one, not the main one."""

    def __init__(
        self,
        connection: Callable[[], BlockingConnection | None],
        *,
        max_bytes: int,
        on_chunk: Callable[[int], None],
    ) -> None:
        self._connection = connection  # the bus's current connection, None while it has none
        self._max_bytes = max_bytes
        self._on_chunk = on_chunk
        self._ch: BlockingChannel | None = None

    def read(self, headers: dict[str, Any], tags: list[int], patience_s: float = 0.0) -> bytes:
        """A blob's chunks, in order, in one buffer. `patience_s`: how long the chunks may take to be
        all counted (an early read has just given them back)."""
        self._size(headers)
        chunks: list[bytes] = []
        self._collect(headers, chunks.append, tags, patience_s)
        # One join: a buffer made first would be cleared, written and copied out again, each
        # pass as long as the receive itself on a 200 MB model.
        return b"".join(chunks)

    def read_to_file(
        self, headers: dict[str, Any], spool: Path, tags: list[int], sync: bool = True,
        patience_s: float = 0.0,
    ) -> Path:
        """A blob's chunks, in order, written to a new file in `spool`: memory holds a few chunks
        (InOrder.AHEAD waiting to be written, and the one read).
        `sync`: on disk before this returns (a message acked once handled), else a cache's file."""
        self._size(headers)
        return spool_file(spool, lambda f: self._collect(headers, f.write, tags, patience_s), sync)

    def requeue(self, tags: list[int]) -> None:
        """Give back the chunks we took, before their envelope goes back to its queue."""
        if self._ch is not None:
            for tag in tags:
                self._ch.basic_nack(tag, requeue=True)

    def delete(self, blob: str) -> None:
        """Drop a settled blob's queue (and the chunks we hold from it)."""
        conn = self._connection()
        if conn is None or not blob.startswith(BLOB_PREFIX):
            return
        try:
            self._channel(conn).queue_delete(blob)
        except pika.exceptions.ChannelClosedByBroker:
            self._ch = None  # already gone: nothing to clean

    def forget(self) -> None:
        """The connection is gone, and its chunk channel with it."""
        self._ch = None

    def _size(self, headers: dict[str, Any]) -> int:
        blob, count, size = headers.get(H_BLOB), headers.get(H_COUNT), headers.get(H_SIZE)
        if not (isinstance(blob, str) and blob.startswith(BLOB_PREFIX)):
            raise DecodeBlobError(f"bad blob name {blob!r}")
        if not (isinstance(count, int) and isinstance(size, int) and 0 < count <= size):
            raise DecodeBlobError("blob envelope without a valid count and size")
        if size > self._max_bytes:
            raise DecodeBlobError(f"{size} bytes is over the {self._max_bytes} limit")
        return size

    def _collect(
        self, headers: dict[str, Any], write: Callable[[bytes], object], tags: list[int], patience_s: float
    ) -> None:
        """Read every chunk of a blob in order into `write`, checking order, size and digest."""
        conn = self._connection()
        assert conn is not None
        ch = self._channel(conn)
        blob, count, size = headers[H_BLOB], headers[H_COUNT], headers[H_SIZE]
        ready, readers = self._ready(ch, blob)
        deadline = time.monotonic() + patience_s
        while ready < count and time.monotonic() < deadline:
            time.sleep(0.05)
            ready, readers = self._ready(ch, blob)
        if ready < count and readers:
            raise BlobHeld(f"{ready} of {count} chunks ready, {readers} reader(s) hold others")
        if ready < count:
            raise DecodeBlobError(f"only {ready} of {count} chunks arrived")
        digest = hashlib.sha256()
        received = 0

        def take(chunk: bytes) -> None:
            digest.update(chunk)
            write(chunk)

        with InOrder() as behind:  # each chunk hashed and written while the next one comes
            for index in range(count):
                method, props, chunk = self._get(ch, blob)
                if method is None:  # counted a moment ago: another reader took it
                    raise DecodeBlobError(f"only {index} of {count} chunks arrived")
                tags.append(method.delivery_tag)
                got = (props.headers or {}).get(H_INDEX)
                if got != index or received + len(chunk) > size:
                    raise DecodeBlobError(f"chunk {got} out of order or oversized (expected {index})")
                self._on_chunk(len(chunk))
                behind.do(take, chunk)
                received += len(chunk)
            behind.wait()
        if received != size:
            raise DecodeBlobError(f"blob has {received} bytes, envelope says {size}")
        if digest.hexdigest() != headers.get(H_DIGEST):
            raise DecodeBlobError("digest mismatch")

    def _ready(self, ch: BlockingChannel, blob: str) -> tuple[int, int]:
        """How many chunks the blob queue holds ready, and how many consumers it has (readers
        that may hold others unacked), asked without waiting for any."""
        try:
            method = ch.queue_declare(blob, passive=True).method
            return int(method.message_count), int(method.consumer_count)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise self._unavailable(exc) from None

    def _get(self, ch: BlockingChannel, blob: str) -> tuple[Any, Any, bytes]:
        try:
            return ch.basic_get(blob, auto_ack=False)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise self._unavailable(exc) from None

    def _unavailable(self, exc: pika.exceptions.ChannelClosedByBroker) -> DecodeBlobError:
        # The blob queue is gone (expired, deleted, never made): only the chunk channel is
        # lost with it; the envelope is rejected on the main one.
        self._ch = None
        return DecodeBlobError(f"blob queue unavailable: {exc.reply_text}")

    def _channel(self, conn: BlockingConnection) -> BlockingChannel:
        if self._ch is None or not self._ch.is_open:
            self._ch = conn.channel()
        return self._ch
