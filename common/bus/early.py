"""Reading a blob while it is sent: its chunks taken as they arrive, before their envelope comes.

    sender ──notice (blob, count, size)──▶ fedmq.x.blob, key fedmq.early.<destination's key>
           ──chunks, committed and counted──▶ fedmq.blob.<id>        (blob.py, unchanged)
           ──envelope──▶ destination
    a consumer that reads early (consume(..., read_early=True): a queue this bus alone consumes;
    and every bus's own reply queue, for a large reply)
        notice ──▶ EarlyReads, on a connection and a thread of their own: consume fedmq.blob.<id>
                   unacked, each chunk checked (order, size), hashed and written as it comes
        envelope ──▶ claim: wait for that read to end ─▶ whole, the envelope's size and digest:
                                                          the body, as if read then
                                                      ─▶ anything else: its chunks given back
                                                          (requeued), read as blob.py reads them
        settled ──▶ the blob queue deleted (blob.py), the read forgotten

What a receiver accepts is unchanged: an envelope still comes only after every chunk is committed
and counted, and a body is handed over only whole and with the envelope's digest. So the time a
large message takes is the sender's, not the sender's and then the reader's.

An early read never acks a chunk: if its process dies the broker requeues them, and the
envelope, redelivered, is read again. A notice is a hint: lost, refused, late or beyond
MAX_READS, the envelope is read as before. A read that stops receiving for STALL_S, or is
whole and unclaimed for UNCLAIMED_S (its sender died before the envelope), gives its chunks
back. The reads run on another thread so that one slow upload never holds up the bus's
other messages; the envelope is only claimed once the sender has sent it all.

A notice is trusted no more than a chunk: one naming another receiver's blob makes this reader
hold those chunks until it gives them back, which any broker user who may read blob queues
(every fedmq user) could do, and worse, by consuming them itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from fedmq.common.bus.blob import BLOB_PREFIX, H_BLOB, H_COUNT, H_DIGEST, H_INDEX, H_SIZE, InOrder

log = structlog.get_logger("fedmq.bus")

NOTICE_PREFIX = "fedmq.early."
MAX_READS = 8  # early reads at once; a notice beyond them is ignored (its envelope is read as before)
STALL_S = 30.0  # an early read whose chunks stop coming this long gives them back
UNCLAIMED_S = 120.0  # a whole early read no envelope claims this long gives its chunks back
CLAIM_STALL_S = 10.0  # a claim waits while chunks come; this long without one, it reads as before
TICK_S = 0.01  # how long the thread waits on the broker before it looks at its commands


def notice_key(destination: str) -> str:
    """The routing key (on fedmq.x.blob) of the notices of blobs sent to `destination`."""
    return NOTICE_PREFIX + destination


def notice_headers(headers: dict[str, Any]) -> dict[str, Any]:
    """A notice's headers, from its blob's envelope headers (the blob, its count and size)."""
    return {key: headers[key] for key in (H_BLOB, H_COUNT, H_SIZE)}


@dataclass(eq=False)
class _Read:
    blob: str
    count: int
    size: int
    spool: Path | None  # the folder its file goes to; None: in memory
    sync: bool
    channel: BlockingChannel | None = None
    path: Path | None = None
    file: IO[bytes] | None = None
    buffer: bytearray | None = None  # in memory: the body, each chunk copied in as it comes
    digest: Any = field(default_factory=hashlib.sha256)
    behind: InOrder | None = None  # each chunk hashed and kept on a thread of its own, in order
    received: int = 0  # chunks
    nbytes: int = 0
    last_tag: int = 0  # the newest chunk's delivery tag on `channel` (none acked, ever)
    error: str = ""
    claimed: bool = False
    touched: float = field(default_factory=time.monotonic)
    ended: threading.Event = field(default_factory=threading.Event)  # whole, or failed

    @property
    def whole(self) -> bool:
        return self.ended.is_set() and not self.error


class EarlyReads:
    """Early reads on a connection of their own; `start`, `claim`, `release`, `forget` are thread-safe."""

    def __init__(
        self,
        params: Callable[[], pika.ConnectionParameters | None],
        *,
        max_bytes: int,
        name: str,
    ) -> None:
        self._params = params  # how to reach the node the bus is on (None while it has none)
        self._max_bytes = max_bytes
        self._name = name
        self._reads: dict[str, _Read] = {}
        self._lock = threading.Lock()  # guards _reads; pika is touched on the thread only
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: BlockingConnection | None = None
        self._stopping = False
        self.handed = 0  # bodies handed over whole by a claim

    # -- the callers' side ----------------------------------------------------

    def start(self, headers: dict[str, Any], spool: Path | None, sync: bool) -> None:
        """A notice came: read its blob now, if it is well formed and a read is free."""
        blob, count, size = headers.get(H_BLOB), headers.get(H_COUNT), headers.get(H_SIZE)
        if not (isinstance(blob, str) and blob.startswith(BLOB_PREFIX) and isinstance(count, int)
                and isinstance(size, int) and 0 < count <= size <= self._max_bytes):
            log.info("early_read_refused", notice=repr(headers)[:300])
            return
        read = _Read(blob, count, size, spool, sync)
        with self._lock:
            if self._stopping or blob in self._reads or len(self._reads) >= MAX_READS:
                return
            self._reads[blob] = read
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-early", daemon=True)
                self._thread.start()
        self._commands.put(lambda: self._begin(read))

    def claim(self, headers: dict[str, Any]) -> tuple[bytes | bytearray | Path | None, bool]:
        """The body of the envelope's blob, read early: (its body, True); (None, True) when a read
        was begun and gave its chunks back (they may take a moment to be counted again); (None,
        False) when none was begun. A body is handed over once, only whole and matching the
        envelope's count, size and digest."""
        blob = headers.get(H_BLOB)
        with self._lock:
            read = self._reads.get(blob) if isinstance(blob, str) else None
        if read is None:
            return None, False
        seen = -1
        while not read.ended.wait(1.0):  # the sender has sent it all: only the last chunks to come
            if read.received == seen and time.monotonic() - read.touched > CLAIM_STALL_S:
                break
            seen = read.received
        matches = (read.whole and headers.get(H_COUNT) == read.count and headers.get(H_SIZE) == read.size
                   and headers.get(H_DIGEST) == read.digest.hexdigest())
        with self._lock:  # once, and not while it expires
            if matches and not read.claimed and self._reads.get(read.blob) is read:
                read.claimed = True
                self.handed += 1
            else:
                matches = False
        if not matches:
            if read.ended.is_set() and read.error:
                log.info("early_read_failed", blob=read.blob, error=read.error)
            self.release(read.blob)
            return None, True
        if read.path is not None:
            return read.path, True
        body, read.buffer = read.buffer, None
        assert body is not None
        return body, True

    def release(self, blob: str) -> None:
        """Give the blob's chunks back to its queue, on the broker before this returns."""
        self._end(blob, requeue=True)

    def forget(self, blob: str) -> None:
        """Its envelope is settled and its queue deleted: drop the read (no chunk goes back)."""
        self._end(blob, requeue=False)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        if thread is not None:
            self._commands.put(lambda: None)
            thread.join(5)

    def _end(self, blob: str, requeue: bool) -> None:
        with self._lock:
            read = self._reads.pop(blob, None)
            thread = self._thread
            if self._stopping:  # the thread is going or gone: its connection's close gives every chunk back
                return
        if read is None or thread is None:
            return
        done = threading.Event()

        def end() -> None:
            try:
                self._close(read, requeue)
            finally:
                done.set()

        self._commands.put(end)
        done.wait(10)

    # -- the thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    break
                busy = bool(self._reads)
            try:
                command: Callable[[], None] | None = self._commands.get(block=not busy, timeout=1.0)
            except queue.Empty:
                command = None
            try:
                while command is not None:  # every command waiting, before the broker is asked again
                    command()
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                if self._conn is not None:  # idle too: its heartbeats answered
                    self._conn.process_data_events(time_limit=TICK_S if busy else 0)
                self._expire()
            except Exception as exc:  # the connection's trouble: every read on it gives up
                self._lost(exc)
        self._lost(None)

    def _begin(self, read: _Read) -> None:
        if read.ended.is_set():
            return
        try:
            if self._conn is None or not self._conn.is_open:
                params = self._params()
                if params is None:
                    raise ConnectionError("the bus is not connected")
                self._conn = pika.BlockingConnection(params)
            read.channel = self._conn.channel()
            # No prefetch limit: no chunk is acked before the envelope settles, so a limit would stop
            # the read there. The socket holds the broker back: it is read only as fast as chunks are handled.
            read.channel.basic_qos(prefetch_count=0)
            read.channel.add_on_cancel_callback(lambda _frame: self._fail(read, "its blob queue was deleted"))
            if read.spool is not None:
                read.spool.mkdir(parents=True, exist_ok=True)
                read.path = read.spool / f"early-{read.blob.removeprefix(BLOB_PREFIX)}.msg"
                read.file = open(read.path, "wb")  # noqa: SIM115 - closed when the read ends
            else:  # the size is bounded (start): no join of the chunks when the read ends
                read.buffer = bytearray(read.size)
            read.behind = InOrder().__enter__()
            read.channel.basic_consume(
                read.blob, lambda _ch, method, props, body: self._chunk(read, method, props, body)
            )
        except pika.exceptions.ChannelClosedByBroker as exc:  # no such blob queue (gone, or never)
            self._fail(read, f"blob queue unavailable: {exc.reply_text}")
        except (pika.exceptions.AMQPError, OSError) as exc:
            self._fail(read, f"{type(exc).__name__}: {exc}")
            if not (self._conn is not None and self._conn.is_open):
                self._conn = None

    def _chunk(self, read: _Read, method: Any, props: Any, body: bytes) -> None:
        read.last_tag = method.delivery_tag
        if read.ended.is_set():
            return
        index = (props.headers or {}).get(H_INDEX)
        if index != read.received or read.nbytes + len(body) > read.size:
            self._fail(read, f"chunk {index} out of order or oversized (expected {read.received})")
            return
        assert read.behind is not None

        at = read.nbytes

        def keep(chunk: bytes) -> None:  # on the read's own thread: hashlib and writes let go of the GIL
            read.digest.update(chunk)
            if read.file is not None:
                read.file.write(chunk)
            elif read.buffer is not None:
                read.buffer[at:at + len(chunk)] = chunk

        read.received += 1
        read.nbytes += len(body)
        read.touched = time.monotonic()
        try:
            read.behind.do(keep, body)
            if read.received < read.count:
                return
            read.behind.wait()
            if read.nbytes != read.size:
                raise ValueError(f"blob has {read.nbytes} bytes, its notice says {read.size}")
            if read.file is not None:
                read.file.flush()
                if read.sync:
                    os.fsync(read.file.fileno())
                read.file.close()
                read.file = None
        except (OSError, ValueError) as exc:  # its file (a full disk): read as before, which says so
            self._fail(read, f"{type(exc).__name__}: {exc}")
            return
        read.touched = time.monotonic()
        read.ended.set()

    def _fail(self, read: _Read, error: str) -> None:
        """The read gives up: its chunks back to the queue, its file gone; a claim reads as before."""
        if read.ended.is_set():
            return
        read.error = error
        # Closed after this callback returns, before any command that comes after (a release).
        self._commands.put(lambda: self._close(read, requeue=True))
        read.ended.set()

    def _close(self, read: _Read, requeue: bool) -> None:
        """On the thread: the chunks given back (requeue) or left to their deleted queue, the
        channel closed, the file removed unless a claim took it."""
        ch, read.channel = read.channel, None
        if ch is not None and ch.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                if requeue and read.last_tag:
                    ch.basic_nack(read.last_tag, multiple=True, requeue=True)
                ch.close()  # close-ok: the broker has every chunk back before a count asks
        behind, read.behind = read.behind, None
        if behind is not None:
            behind.__exit__(None, None, None)
        if read.file is not None:
            with contextlib.suppress(OSError):
                read.file.close()
            read.file = None
        if read.path is not None and not read.claimed:
            read.path.unlink(missing_ok=True)
        read.buffer = None

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            reads = list(self._reads.values())
        for read in reads:
            if not read.ended.is_set() and now - read.touched > STALL_S:
                self._fail(read, f"no chunk for {STALL_S:.0f} s")
            elif read.ended.is_set() and now - read.touched > UNCLAIMED_S:
                with self._lock:
                    if read.claimed or self._reads.get(read.blob) is not read:
                        continue
                    del self._reads[read.blob]
                self._close(read, requeue=True)

    def _lost(self, exc: Exception | None) -> None:
        """The connection is gone (exc), or the bus stops (None): the broker requeues every chunk
        it held. A whole read is still whole (its chunks checked): a claim may take it; when the
        bus stops, every read unclaimed is dropped with its file."""
        if exc is not None:
            log.warning("early_reads_lost", error=f"{type(exc).__name__}: {exc}"[:300])
        conn, self._conn = self._conn, None
        with self._lock:
            reads = list(self._reads.values())
            if exc is None:
                self._reads.clear()
        for read in reads:
            read.channel = None
            if exc is None or not read.ended.is_set():
                read.error = read.error or "its connection was lost"
                self._close(read, requeue=False)
                read.ended.set()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
