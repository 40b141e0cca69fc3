"""A large message read while it is sent (bus/early.py), on a real broker: handed over whole or
read as before, and never a chunk lost when no envelope comes."""

from __future__ import annotations

import hashlib
import os
import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pika
import pytest

from fedmq.common.bus import early, topology
from fedmq.common.bus.base import Delivery
from fedmq.common.bus.blob import BLOB_PREFIX, H_BLOB, H_COUNT, H_DIGEST, H_INDEX, H_SIZE
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.settings import Settings
from tests.integration.test_blob_leftovers import running
from tests.integration.test_bus_contract import WAIT
from tests.rabbit import dead_letters, fresh_vhost

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker

FRAME = 64 * 1024
BODY = os.urandom(3 * 1024 * 1024 + 123)  # 49 chunks, the last one short


def receive(
    url: str, tmp_path: Path, *, spool: bool, handle: Any = None, count: int = 1, body: bytes = BODY,
    handed: int | None = None, pause_s: float = 0.0,
) -> list[tuple[bytes, bool, int]]:
    """Publish `body` to the aggregator's queue, `count` times (`pause_s` apart); what a read_early
    consumer got each time it was handed a message, `handed` times (default `count`): (body bytes,
    whether it came from a file, read early so far)."""
    settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=FRAME)
    got: queue.Queue[tuple[bytes, bool, int]] = queue.Queue()
    with running(settings, "receiver") as rx, running(settings, "sender") as tx:

        def handler(delivery: Delivery) -> None:
            body = delivery.body_path.read_bytes() if delivery.body_path else bytes(delivery.body)
            got.put((body, delivery.body_path is not None, rx.blobs_read_early))
            (handle or (lambda d: d.ack()))(delivery)

        rx.consume(topology.AGGREGATOR, handler, spool=tmp_path / "spool" if spool else None, read_early=True)
        time.sleep(0.2)  # its notices' binding in place (consume returns before the loop has run it)
        for _ in range(count):
            tx.publish(topology.AGGREGATOR, body)
            time.sleep(pause_s)
        results: list[tuple[bytes, bool, int]] = []
        try:
            while True:  # and a moment more: nothing else comes
                results.append(got.get(timeout=WAIT if len(results) < (handed or count) else 1.0))
        except queue.Empty:
            pass
    return results


@pytest.mark.parametrize("spool", [False, True], ids=["in memory", "into a spool file"])
def test_a_large_message_is_read_while_it_is_sent_and_handed_over_whole(tmp_path: Path, spool: bool) -> None:
    with fresh_vhost() as url:
        [(body, from_file, read_early)] = receive(url, tmp_path, spool=spool)
        assert hashlib.sha256(body).digest() == hashlib.sha256(BODY).digest()
        assert from_file == spool
        assert read_early == 1, "handed over from its early read, not read again after the envelope"
        assert not list((tmp_path / "spool").glob("*")), "the spool file is gone once the message is settled"


def test_an_early_read_that_does_not_match_its_envelope_is_given_back_and_read_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = early.EarlyReads.start

    def lying_notice(self: early.EarlyReads, headers: dict[str, Any], spool: Path | None, sync: bool) -> None:
        start(self, {**headers, H_SIZE: headers[H_SIZE] + 1}, spool, sync)  # one byte more than it has

    monkeypatch.setattr(early.EarlyReads, "start", lying_notice)
    with fresh_vhost() as url:
        [(body, _, read_early)] = receive(url, tmp_path, spool=True)
        assert body == BODY and read_early == 0


def test_a_message_given_back_after_its_early_read_is_read_again_whole(tmp_path: Path) -> None:
    seen: list[Delivery] = []

    def requeue_the_first(delivery: Delivery) -> None:
        seen.append(delivery)
        delivery.requeue() if len(seen) == 1 else delivery.ack()

    with fresh_vhost() as url:
        first, second = receive(url, tmp_path, spool=True, handle=requeue_the_first, handed=2)
        assert first[0] == BODY and first[2] == 1, "the first time, from its early read"
        assert second[0] == BODY and second[2] == 1, "then read again from its chunks, given back whole"


def send_without_envelope(url: str, chunks: int) -> tuple[str, int]:
    """What a sender that dies before its envelope leaves: the notice, and `chunks` of the blob's
    chunks (of 4). The blob queue's name and the blob's full count."""
    blob, count = f"{BLOB_PREFIX}{os.urandom(8).hex()}", 4
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare(blob, durable=True, arguments={"x-expires": 600_000})
    ch.queue_bind(blob, topology.BLOBS, routing_key=blob)
    notice = {H_BLOB: blob, H_COUNT: count, H_SIZE: count * FRAME}
    ch.basic_publish(topology.BLOBS, early.notice_key(topology.AGGREGATOR), b"",
                     pika.BasicProperties(headers=notice))
    for index in range(chunks):
        ch.basic_publish(topology.BLOBS, blob, os.urandom(FRAME),
                         pika.BasicProperties(delivery_mode=2, headers={H_BLOB: blob, H_INDEX: index}))
    conn.close()
    return blob, count


def ready_chunks(url: str, blob: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_declare(blob, passive=True).method.message_count)
    finally:
        conn.close()


@pytest.mark.parametrize("sent", [4, 2], ids=["whole, never claimed", "stalled"])
def test_chunks_an_early_read_holds_go_back_when_no_envelope_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sent: int
) -> None:
    monkeypatch.setattr(early, "UNCLAIMED_S", 1.0)
    monkeypatch.setattr(early, "STALL_S", 1.0)
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=FRAME)
        with running(settings, "receiver") as rx:
            rx.consume(topology.AGGREGATOR, lambda d: d.ack(), spool=tmp_path / "spool", read_early=True)
            time.sleep(0.2)
            blob, _ = send_without_envelope(url, sent)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and ready_chunks(url, blob) == sent:  # not taken yet
                time.sleep(0.05)
            taken = ready_chunks(url, blob)
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline and ready_chunks(url, blob) < sent:
                time.sleep(0.1)
            assert taken < sent, "the early read took chunks before any envelope came"
            assert ready_chunks(url, blob) == sent, "and gave every one back"
            assert not list((tmp_path / "spool").glob("*")), "its file removed"


@contextmanager
def asking(url: str, tmp_path: Path) -> Iterator[RabbitBus]:
    """A bus to ask from, and another answering every request on the model queue with BODY."""
    settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=FRAME)
    with running(settings, "asker") as asker, running(settings, "answerer") as answerer:

        def answer(delivery: Delivery) -> None:
            answerer.reply(delivery, BODY)
            delivery.ack()

        answerer.consume(topology.MODEL, answer)
        time.sleep(0.2)  # its consumer in place (consume returns before the loop has run it)
        yield asker


@pytest.mark.parametrize("large", [False, True], ids=["request", "request_large into a file"])
def test_a_large_reply_is_read_while_it_is_sent(tmp_path: Path, large: bool) -> None:
    with fresh_vhost() as url, asking(url, tmp_path) as asker:
        if large:
            folder = tmp_path / "models"
            got = asker.request_large(topology.MODEL, b"?", timeout=WAIT, spool=lambda: folder)
            assert isinstance(got, Path) and got.parent == tmp_path / "models"
            body = got.read_bytes()
        else:
            body = asker.request(topology.MODEL, b"?", timeout=WAIT)
            assert type(body) is bytes, "request() returns bytes, as its callers check"
        assert body == BODY and asker.blobs_read_early == 1


def test_every_one_of_many_large_messages_is_read_early_none_holding_a_read(tmp_path: Path) -> None:
    body = BODY[: 5 * FRAME]
    with fresh_vhost() as url:
        got = receive(url, tmp_path, spool=True, count=early.MAX_READS + 4, body=body, pause_s=0.1)
        assert [seen for seen, _, _ in got] == [body] * (early.MAX_READS + 4)
        assert got[-1][2] == early.MAX_READS + 4, "each settled read gave its place back"


def test_an_early_read_whose_digest_is_not_its_envelopes_is_refused_as_before(tmp_path: Path) -> None:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=FRAME)
        handled: list[Delivery] = []
        with running(settings, "receiver") as rx:
            rx.consume(topology.AGGREGATOR, handled.append, spool=tmp_path / "spool", read_early=True)
            time.sleep(0.2)
            blob, count = send_without_envelope(url, 4)
            conn = pika.BlockingConnection(pika.URLParameters(url))
            envelope = {H_BLOB: blob, H_COUNT: count, H_SIZE: count * FRAME, H_DIGEST: "0" * 64}
            conn.channel().basic_publish(topology.EXCHANGES[topology.AGGREGATOR], topology.AGGREGATOR, b"",
                                         pika.BasicProperties(delivery_mode=2, headers=envelope))
            conn.close()
            deadline = time.monotonic() + WAIT
            dead: list[tuple[dict[str, Any], bytes]] = []
            while not dead and time.monotonic() < deadline:
                time.sleep(0.1)
                dead = dead_letters(url)
            assert handled == [] and rx.blobs_read_early == 0
            assert [headers["x-fedmq-reason"] for headers, _ in dead] == ["blob: digest mismatch"]


def test_chunks_given_back_slowly_are_waited_for_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release that outlasts its wait leaves chunks held: the envelope is tried again later."""
    monkeypatch.setattr(early, "RELEASE_WAIT_S", 0.2)
    close = early.EarlyReads._close

    def slow_close(self: early.EarlyReads, read: Any, requeue: bool) -> None:
        time.sleep(3.0)  # longer than the release waits, and than the reader's patience after it
        close(self, read, requeue)

    monkeypatch.setattr(early.EarlyReads, "_close", slow_close)
    seen: list[Delivery] = []

    def requeue_the_first(delivery: Delivery) -> None:
        seen.append(delivery)
        delivery.requeue() if len(seen) == 1 else delivery.ack()

    with fresh_vhost() as url:
        got = receive(url, tmp_path, spool=True, handle=requeue_the_first, handed=2)
        assert [body == BODY for body, _, _ in got] == [True, True]
        assert dead_letters(url) == []


def test_a_large_reply_whose_chunks_are_still_held_fails_its_request_to_be_asked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its early read does not match (a lying notice) and gives the chunks back slower than every
    wait: the asker is told to ask again, never handed an empty body."""
    monkeypatch.setattr(early, "RELEASE_WAIT_S", 0.2)
    start, close = early.EarlyReads.start, early.EarlyReads._close

    def lying_notice(self: early.EarlyReads, headers: dict[str, Any], spool: Path | None, sync: bool) -> None:
        start(self, {**headers, H_SIZE: headers[H_SIZE] + 1}, spool, sync)

    def slow_close(self: early.EarlyReads, read: Any, requeue: bool) -> None:
        time.sleep(3.0)
        close(self, read, requeue)

    monkeypatch.setattr(early.EarlyReads, "start", lying_notice)
    monkeypatch.setattr(early.EarlyReads, "_close", slow_close)
    with (fresh_vhost() as url, asking(url, tmp_path) as asker,
          pytest.raises(ConnectionError, match="held")):
        asker.request(topology.MODEL, b"?", timeout=WAIT)
