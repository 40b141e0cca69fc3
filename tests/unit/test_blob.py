"""The chunked-blob protocol over a stand-in pika channel: what is sent is read back, or refused."""

from __future__ import annotations

import errno
import hashlib
import threading
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pika
import pika.exceptions
import pytest

from fedmq.common.bus.blob import (
    BLOB_PREFIX,
    H_BLOB,
    H_COUNT,
    H_DIGEST,
    H_INDEX,
    H_SIZE,
    BlobIncomplete,
    BlobReader,
    BlobWriter,
    DecodeBlobError,
    InOrder,
)
from fedmq.common.bus.early import NOTICE_PREFIX, notice_key
from fedmq.common.bus.topology import BLOBS
from fedmq.common.codec.pack import Encoded

BODY = bytes(range(256)) * 3 + b"tail"  # 772 bytes: 8 chunks of 100, the last short
ORPHANS: list[str] = []  # blob queues a failed send could not delete (on_orphan)


class FakeChannel:
    """Queues in a dict, bound to the blob exchange by name; what goes elsewhere is kept as the envelope."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[tuple[pika.BasicProperties, bytes]]] = {}
        self.envelopes: list[tuple[str, str, pika.BasicProperties]] = []
        self.nacked: list[int] = []
        self.bound: set[tuple[str, str, str]] = set()  # (exchange, key, queue)
        self.gets = 0
        self.is_open = True
        self._tags = 0
        self.transactional = False
        self.uncommitted: list[tuple[str, pika.BasicProperties, bytes]] = []  # chunks held till commit
        self.commits: list[int] = []  # chunks in each commit
        self.rolled_back = 0
        self.notices: list[tuple[str, pika.BasicProperties]] = []  # (key, props) on the blob exchange
        self._on_return: Any = None
        self._impl = self  # pika's underlying channel, where the return callback goes

    def add_on_return_callback(self, callback: Any) -> None:
        self._on_return = callback

    def returned(self, exchange: str, key: str, props: pika.BasicProperties, body: bytes) -> None:
        """As the broker returns a mandatory message no queue took: before the commit's answer."""
        self._on_return(self, SimpleNamespace(exchange=exchange, routing_key=key), props, body)

    def queue_declare(
        self, queue: str, durable: bool = False, arguments: dict[str, Any] | None = None,
        passive: bool = False,
    ) -> SimpleNamespace:
        if passive and queue not in self.queues:
            self.is_open = False
            raise pika.exceptions.ChannelClosedByBroker(404, f"NOT_FOUND - no queue '{queue}'")
        ready = len(self.queues.setdefault(queue, deque()))
        return SimpleNamespace(method=SimpleNamespace(queue=queue, message_count=ready, consumer_count=0))

    def queue_bind(self, queue: str, exchange: str, routing_key: str) -> None:
        self.bound.add((exchange, routing_key, queue))

    def basic_publish(
        self, exchange: str, key: str, body: bytes, props: pika.BasicProperties, mandatory: bool = False
    ) -> None:
        assert exchange != "", "nothing goes through the default exchange"
        if key.startswith(NOTICE_PREFIX):
            assert exchange == BLOBS and not mandatory, "a notice is a hint on the blob exchange"
            self.notices.append((key, props))
            return
        if (exchange, key, key) in self.bound and key in self.queues:
            if self.transactional:  # as the broker: enqueued only at the commit
                self.uncommitted.append((key, props, body))
            else:
                self.queues[key].append((props, body))
        else:
            assert body == b""
            self.envelopes.append((exchange, key, props))

    def basic_get(self, queue: str, auto_ack: bool = False) -> tuple[Any, Any, Any]:
        self.gets += 1
        if queue not in self.queues:
            self.is_open = False
            raise pika.exceptions.ChannelClosedByBroker(404, f"NOT_FOUND - no queue '{queue}'")
        if not self.queues[queue]:
            return None, None, None
        props, body = self.queues[queue].popleft()
        self._tags += 1
        return SimpleNamespace(delivery_tag=self._tags), props, body

    def basic_nack(self, tag: int, requeue: bool = False) -> None:
        self.nacked.append(tag)

    def queue_delete(self, queue: str) -> None:
        self.queues.pop(queue, None)

    def tx_select(self) -> None:
        self.transactional = True

    def tx_commit(self) -> None:
        self.commits.append(len(self.uncommitted))
        for key, props, body in self.uncommitted:
            if key in self.queues:
                self.queues[key].append((props, body))
        self.uncommitted.clear()

    def tx_rollback(self) -> None:
        self.rolled_back += len(self.uncommitted)
        self.uncommitted.clear()


class FakeConnection:
    def __init__(self, ch: FakeChannel) -> None:
        self.ch = ch
        self.opened = 0

    def channel(self) -> FakeChannel:
        self.opened += 1
        self.ch.is_open = True
        return self.ch


def publish_blob(
    ch: FakeChannel, exchange: str, key: str, body: bytes | Encoded, props: pika.BasicProperties, *,
    mandatory: bool, frame_bytes: int, expiry_s: int, on_chunk: Any, on_orphan: Any,
    commit_bytes: int = 64 * 1024,
) -> None:
    """A BlobWriter's publish, its chunks on the same stand-in channel as the envelope."""
    conn = FakeConnection(ch)
    writer = BlobWriter(lambda: conn, frame_bytes=frame_bytes, expiry_s=expiry_s, commit_bytes=commit_bytes)
    encoded = body if isinstance(body, Encoded) else Encoded([body])
    writer.publish(ch, exchange, key, encoded, props, mandatory=mandatory, notice=notice_key(key),
                   on_chunk=on_chunk, on_orphan=on_orphan)


def sent(body: bytes | Encoded = BODY, frame: int = 100) -> tuple[FakeChannel, dict[str, Any], list[int]]:
    """Publish `body` as a blob; the channel, the envelope's headers and the chunk sizes counted."""
    ch = FakeChannel()
    counted: list[int] = []
    props = pika.BasicProperties(delivery_mode=2, correlation_id="c1", headers={"k": "v"}, user_id="learner")
    publish_blob(ch, "fedmq.x.aggregator", "fedmq.aggregator", body, props, mandatory=True, frame_bytes=frame,
                 expiry_s=600, on_chunk=counted.append, on_orphan=ORPHANS.append)
    [(exchange, key, envelope)] = ch.envelopes
    assert (exchange, key, envelope.correlation_id) == ("fedmq.x.aggregator", "fedmq.aggregator", "c1")
    assert envelope.user_id == "learner"  # the sender's broker user, which RabbitMQ checks
    return ch, dict(envelope.headers), counted


def reader(ch: FakeChannel, max_bytes: int = 10_000) -> tuple[BlobReader, list[int]]:
    counted: list[int] = []
    conn = FakeConnection(ch)
    blobs = BlobReader(lambda: conn, max_bytes=max_bytes, on_chunk=counted.append)
    return blobs, counted


def test_a_blob_is_read_back_whole_in_memory_and_each_chunk_is_counted() -> None:
    ch, headers, sent_sizes = sent()
    assert headers["k"] == "v" and headers[H_BLOB].startswith(BLOB_PREFIX)
    assert (headers[H_COUNT], headers[H_SIZE]) == (8, len(BODY))
    assert headers[H_DIGEST] == hashlib.sha256(BODY).hexdigest()
    assert [props.headers[H_INDEX] for props, _ in ch.queues[headers[H_BLOB]]] == list(range(8))
    blobs, read_sizes = reader(ch)
    tags: list[int] = []
    assert blobs.read(headers, tags) == BODY
    assert tags == list(range(1, 9))
    assert read_sizes == sent_sizes == [100] * 7 + [72]


def test_a_body_in_parts_goes_in_the_same_chunks_as_joined() -> None:
    parts: list[bytes | memoryview] = [BODY[:33], memoryview(BODY[33:250]), b"", memoryview(BODY)[250:]]
    ch, headers, sent_sizes = sent(Encoded(parts))
    assert (headers[H_COUNT], headers[H_SIZE]) == (8, len(BODY))
    assert headers[H_DIGEST] == hashlib.sha256(BODY).hexdigest()
    assert sent_sizes == [100] * 7 + [72]
    assert reader(ch)[0].read(headers, []) == BODY


class LosingChannel(FakeChannel):
    """Returns the fourth chunk, as the broker returns a mandatory one that no queue took."""

    def basic_publish(
        self, exchange: str, key: str, body: bytes, props: pika.BasicProperties, mandatory: bool = False
    ) -> None:
        if (props.headers or {}).get(H_INDEX) != 3:
            super().basic_publish(exchange, key, body, props, mandatory)
        else:
            assert mandatory, "a chunk no queue takes must come back, not vanish"
            self.returned(exchange, key, props, body)


def test_a_notice_names_the_blob_for_an_early_reader_before_any_chunk_is_sent() -> None:
    ch = FakeChannel()
    chunks_at_notice: list[int] = []
    notices = ch.notices

    class Watching(list[tuple[str, pika.BasicProperties]]):
        def append(self, item: tuple[str, pika.BasicProperties]) -> None:
            chunks_at_notice.append(len(ch.queues[item[1].headers[H_BLOB]]) + len(ch.uncommitted))
            super().append(item)

    ch.notices = Watching(notices)
    publish_blob(ch, "fedmq.x.aggregator", "fedmq.aggregator", BODY, pika.BasicProperties(user_id="learner"),
                 mandatory=True, frame_bytes=100, expiry_s=600, on_chunk=lambda n: None,
                 on_orphan=ORPHANS.append)
    [(key, notice)] = ch.notices
    [(_, _, envelope)] = ch.envelopes
    assert key == NOTICE_PREFIX + "fedmq.aggregator" and chunks_at_notice == [0]
    assert notice.headers == {H_BLOB: envelope.headers[H_BLOB], H_COUNT: 8, H_SIZE: len(BODY)}
    assert notice.user_id == "learner", "the broker checks who sends it, as for any message"


def test_chunks_are_committed_each_time_the_commit_size_is_reached_and_at_the_end() -> None:
    ch = FakeChannel()
    publish_blob(ch, "fedmq.x.aggregator", "fedmq.aggregator", BODY, pika.BasicProperties(),
                 mandatory=True, frame_bytes=100, expiry_s=600, on_chunk=lambda n: None,
                 on_orphan=ORPHANS.append, commit_bytes=250)
    assert ch.commits == [3, 3, 2], "100-byte chunks: a commit once 250 bytes wait, and the rest"
    assert ch.uncommitted == [] and len(ch.envelopes) == 1
    [(_, _, envelope)] = ch.envelopes
    assert len(ch.queues[envelope.headers[H_BLOB]]) == 8


def test_a_chunk_the_broker_returns_sends_no_envelope_and_the_blob_is_deleted() -> None:
    ch = LosingChannel()
    with pytest.raises(BlobIncomplete, match="1 of its 8 chunks found no queue"):
        publish_blob(ch, "fedmq.x.aggregator", "fedmq.aggregator", BODY, pika.BasicProperties(),
                     mandatory=True, frame_bytes=100, expiry_s=600, on_chunk=lambda n: None,
                     on_orphan=ORPHANS.append)
    assert ch.envelopes == [] and ch.queues == {}


def test_a_blob_is_read_back_into_a_file_in_the_spool(tmp_path: Path) -> None:
    ch, headers, _ = sent()
    path = reader(ch)[0].read_to_file(headers, tmp_path / "spool", [])
    assert path.parent == tmp_path / "spool" and path.read_bytes() == BODY


def test_a_wrong_digest_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    ch, headers, _ = sent()
    with pytest.raises(DecodeBlobError, match="digest mismatch"):
        reader(ch)[0].read_to_file({**headers, H_DIGEST: "00"}, tmp_path, [])
    assert list(tmp_path.iterdir()) == []


def test_chunks_out_of_order_are_refused() -> None:
    ch, headers, _ = sent()
    chunks = ch.queues[headers[H_BLOB]]
    chunks[0], chunks[1] = chunks[1], chunks[0]
    with pytest.raises(DecodeBlobError, match=r"chunk 1 out of order or oversized \(expected 0\)"):
        reader(ch)[0].read(headers, [])


def test_a_blob_missing_chunks_is_refused_at_once_before_any_chunk_is_read() -> None:
    ch, headers, _ = sent()
    ch.queues[headers[H_BLOB]].pop()
    with pytest.raises(DecodeBlobError, match="only 7 of 8 chunks arrived"):
        reader(ch)[0].read(headers, [])
    assert ch.gets == 0  # the passive declare counted them: nothing waited, nothing taken


def test_a_blob_over_the_limit_is_refused_before_any_chunk_is_read() -> None:
    ch, headers, _ = sent()
    with pytest.raises(DecodeBlobError, match=f"{len(BODY)} bytes is over the 100 limit"):
        reader(ch, max_bytes=100)[0].read(headers, [])
    assert ch.gets == 0


@pytest.mark.parametrize("bad", [{H_BLOB: "fedmq.tasks"}, {H_COUNT: 0}, {H_SIZE: "772"}, {H_COUNT: 900}])
def test_an_envelope_with_bad_headers_is_refused(bad: dict[str, Any]) -> None:
    ch, headers, _ = sent()
    with pytest.raises(DecodeBlobError):
        reader(ch)[0].read({**headers, **bad}, [])
    assert ch.gets == 0


def test_a_missing_blob_queue_costs_only_the_chunk_channel() -> None:
    ch, headers, _ = sent()
    ch.queue_delete(headers[H_BLOB])
    blobs, _ = reader(ch)
    with pytest.raises(DecodeBlobError, match="blob queue unavailable: NOT_FOUND"):
        blobs.read(headers, [])
    blobs.requeue([1, 2])  # the channel is gone: nothing to give back on it
    assert ch.nacked == []


def test_requeue_gives_back_the_chunks_taken_and_delete_drops_the_queue() -> None:
    ch, headers, _ = sent()
    blobs, _ = reader(ch)
    tags: list[int] = []
    blobs.read(headers, tags)
    blobs.requeue(tags)
    assert ch.nacked == tags
    blobs.delete("fedmq.tasks")  # not a blob: never deleted
    blobs.delete(headers[H_BLOB])
    assert headers[H_BLOB] not in ch.queues


class FailingChannel(FakeChannel):
    """Fails the n-th publish (a chunk or the envelope; not the notice) with `error`; open or not
    afterwards."""

    def __init__(self, fail_at: int, error: Exception, stays_open: bool) -> None:
        super().__init__()
        self.fail_at, self.error, self.stays_open, self.published = fail_at, error, stays_open, 0

    def basic_publish(
        self, exchange: str, key: str, body: bytes, props: pika.BasicProperties, mandatory: bool = False
    ) -> None:
        self.published += not key.startswith(NOTICE_PREFIX)
        if self.published == self.fail_at:
            self.is_open = self.stays_open
            raise self.error
        super().basic_publish(exchange, key, body, props, mandatory)


def publish_failing(ch: FailingChannel) -> list[str]:
    """Publish BODY (8 chunks and an envelope) on `ch`, expecting its error; the orphans handed over."""
    orphans: list[str] = []
    with pytest.raises(type(ch.error)):
        publish_blob(ch, "fedmq.x.aggregator", "fedmq.aggregator", BODY, pika.BasicProperties(),
                     mandatory=True, frame_bytes=100, expiry_s=600, on_chunk=lambda n: None,
                     on_orphan=orphans.append)
    return orphans


def test_a_send_failing_between_chunks_deletes_its_blob_queue_and_rolls_its_chunks_back() -> None:
    ch = FailingChannel(3, pika.exceptions.NackError([]), stays_open=True)
    assert publish_failing(ch) == [] and ch.queues == {}
    assert ch.rolled_back == 2 and ch.uncommitted == [], "nothing left for the next blob's commit"


def test_a_send_cut_off_between_chunks_leaves_its_blob_queue_to_the_next_connection() -> None:
    ch = FailingChannel(3, pika.exceptions.StreamLostError("gone"), stays_open=False)
    orphans = publish_failing(ch)
    assert orphans == list(ch.queues) and len(orphans) == 1


def test_an_envelope_the_broker_refuses_deletes_its_blob_queue() -> None:
    ch = FailingChannel(9, pika.exceptions.UnroutableError([]), stays_open=True)
    assert publish_failing(ch) == [] and ch.queues == {}


def test_an_envelope_lost_before_its_confirm_keeps_its_blob_for_the_reader() -> None:
    ch = FailingChannel(9, pika.exceptions.StreamLostError("gone"), stays_open=False)
    assert publish_failing(ch) == [] and len(ch.queues[next(iter(ch.queues))]) == 8


def test_chunks_are_taken_in_order_on_one_other_thread_and_its_failure_reaches_the_reader() -> None:
    taken: list[tuple[bytes, str]] = []
    with InOrder() as behind:
        for i in range(40):
            behind.do(lambda chunk: taken.append((chunk, threading.current_thread().name)), bytes([i]))
        behind.wait()
    assert [chunk for chunk, _ in taken] == [bytes([i]) for i in range(40)]
    assert {name for _, name in taken} != {threading.current_thread().name}

    def full(chunk: bytes) -> None:
        if chunk == b"\x03":
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"), InOrder() as behind:
        for i in range(100):
            behind.do(full, bytes([i]))
        behind.wait()
    assert not any(t.name.startswith("blob-chunks") for t in threading.enumerate())
