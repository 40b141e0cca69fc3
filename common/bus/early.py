"""Reading a blob while it is sent: its chunks taken as they arrive, before their envelope comes.

    sender ──notice (blob, count, size)──▶ fedmq.x.blob, key fedmq.early.<destination's key>
           ──chunks, committed, none returned──▶ fedmq.blob.<id>     (blob.py)
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
(none returned as unroutable), and a body is handed over only whole and with the envelope's
digest. So the time a large message takes is the sender's, not the sender's and then the reader's.

An early read never acks a chunk: if its process dies the broker requeues them, and the
envelope, redelivered, is read again. A notice is a hint: lost, refused, late or beyond
MAX_READS, the envelope is read as before. A read that stops receiving for STALL_S, or is
whole and unclaimed for UNCLAIMED_S (its sender died before the envelope), gives its chunks
back; so does a claimed one whose envelope was never settled here (CLAIMED_S, or at once when
the bus's connection is lost: the envelope comes again). Chunks given back more slowly than a
reader waits for them are never taken for lost: the envelope goes back to its queue for a
moment (blob.BlobHeld), counted by the delivery limit.

The reads run on another thread so that one slow upload never holds up the bus's other
messages; the envelope is only claimed once the sender has sent it all.

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
STALL_S = 120.0  # an early read whose chunks stop coming this long gives them back
UNCLAIMED_S = 120.0  # a whole early read no envelope claims this long gives its chunks back
CLAIMED_S = 3600.0  # a claimed read whose envelope never settles here (its connection lost) gives them back
FAILED_S = 10.0  # a failed read is remembered this long: a claim then waits for its chunks to be counted
# The bus's thread waits in a claim and a release, its connection silent meanwhile: together they
# stay well under a heartbeat's timeout (FEDMQ_HEARTBEAT_S, 30 s by default).
CLAIM_STALL_S = 5.0  # a claim waits while chunks come; this long without one, it reads as before
CLAIM_MAX_S = 10.0  # and never longer than this in all
RELEASE_WAIT_S = 5.0  # how long a release waits for the chunks to be back on the broker
RECOUNT_S = 2.0  # how long a reader then gives those chunks to be counted in their queue again
TICK_S = 0.01  # how long the thread waits on the broker before it looks at its commands
IDLE_S = 0.1  # how long it waits for a command with reads but no connection (none to wait on)


def notice_key(destination: str) -> str:
    """The routing key (on fedmq.x.blob) of the notices of blobs sent to `destination`."""
    return NOTICE_PREFIX + destination


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
    closing: bool = False  # its chunks being given back (or left to their deleted queue): not claimable
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
        if read.closing:  # its chunks are on their way back: never handed over
            return None, True
        deadline = time.monotonic() + CLAIM_MAX_S
        while not read.ended.wait(0.5):  # the sender has sent it all: only the last chunks to come
            now = time.monotonic()
            if now > deadline or now - read.touched > CLAIM_STALL_S:
                break
        matches = (read.whole and headers.get(H_COUNT) == read.count and headers.get(H_SIZE) == read.size
                   and headers.get(H_DIGEST) == read.digest.hexdigest())
        with self._lock:  # once, and not while it is given back
            if matches and not read.claimed and not read.closing and self._reads.get(read.blob) is read:
                read.claimed = True
                read.touched = time.monotonic()
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
        """Give the blob's chunks back to its queue: on the broker before this returns, unless that
        takes over RELEASE_WAIT_S (a reader that finds them held then tries again later: BlobHeld)."""
        self._end(blob, requeue=True, wait=True)

    def forget(self, blob: str) -> None:
        """Its envelope is settled and its queue deleted: drop the read (the chunks it holds go
        with the queue; had the deletion failed, closing its channel gives them back)."""
        self._end(blob, requeue=False, wait=False)

    def release_claimed(self) -> None:
        """The bus's connection is lost: the envelopes of claimed reads come again, to be read anew."""
        with self._lock:
            claimed = [read.blob for read in self._reads.values() if read.claimed]
        for blob in claimed:
            self._end(blob, requeue=True, wait=False)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        if thread is not None:
            self._commands.put(lambda: None)
            thread.join(5)

    def _end(self, blob: str, requeue: bool, wait: bool) -> None:
        """Close the read on its thread; it stays known (closing, not claimable) until it is closed,
        so that a claim meanwhile knows its chunks are on their way back."""
        with self._lock:
            read = self._reads.get(blob)
            if read is None or self._thread is None or self._stopping or read.closing:
                return  # (stopping: the thread's connection closes, which gives every chunk back;
                # closing: a close is under way, which a reader that finds chunks held waits for)
            read.closing = True
        done = threading.Event()

        def end() -> None:
            try:
                self._close(read, requeue)
            finally:
                self._drop(read)
                done.set()

        self._commands.put(end)
        if wait:
            done.wait(RELEASE_WAIT_S)

    def _drop(self, read: _Read) -> None:
        with self._lock:
            if self._reads.get(read.blob) is read:
                del self._reads[read.blob]

    # -- the thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    break
                busy = bool(self._reads)
            try:  # with reads, the broker is waited on below; with none to wait on, the commands
                wait = 1.0 if not busy else IDLE_S if self._conn is None else 0.0
                command: Callable[[], None] | None = self._commands.get(block=wait > 0, timeout=wait or None)
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
        if read.spool is None and read.buffer is None:  # made once chunks come: none is joined at the end
            read.buffer = bytearray(read.size)
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
        read.touched = time.monotonic()  # FAILED_S counts from here
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
        """On the thread: a stalled read fails; a failed, unclaimed or long-claimed one is dropped,
        its chunks given back."""
        now = time.monotonic()
        with self._lock:
            reads = list(self._reads.values())
        for read in reads:
            idle = now - read.touched
            if not read.ended.is_set():
                if idle > STALL_S:
                    self._fail(read, f"no chunk for {STALL_S:.0f} s")
                continue
            limit = CLAIMED_S if read.claimed else FAILED_S if read.error else UNCLAIMED_S
            if idle <= limit:
                continue
            with self._lock:  # not one a claim has just taken, nor one already being closed
                taken = read.claimed != (limit == CLAIMED_S)  # claimed since `limit` was chosen
                if taken or read.closing or self._reads.get(read.blob) is not read:
                    continue
                read.closing = True
            try:
                self._close(read, requeue=True)
            finally:
                self._drop(read)

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
