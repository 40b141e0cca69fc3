"""What only a real broker can do to us: close every connection, cancel consumers, send broken blobs."""

from __future__ import annotations

import hashlib
import queue
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pika
import pytest

from fedmq.common.bus.base import Delivery
from fedmq.common.bus.blob import H_BLOB, H_COUNT, H_DIGEST, H_INDEX, H_SIZE
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.messages import JobEvent
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import EmbeddedRuns, assert_bit_identical, assert_matches_reference, small_job
from tests.integration.test_bus_contract import WAIT
from tests.rabbit import dead_letters, fresh_vhost
from tests.reference import reference_fedavg

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker


def test_a_job_survives_the_broker_closing_every_connection(
    tmp_path: Path, embedded_runs: EmbeddedRuns
) -> None:
    # Rounds enough to outlast rabbitmqctl (a second or more on a loaded machine): the close
    # must land while the job runs, not after it ended.
    spec = small_job(rounds=30, round_timeout_s=20)
    with fresh_vhost() as url:
        vhost = urlsplit(url).path.lstrip("/")
        settings = Settings(broker_url=url, state_dir=tmp_path, retry_initial_s=0.2)
        closed = threading.Event()

        def on_event(event: JobEvent) -> None:
            if event.kind == "round_completed" and event.round == 2 and not closed.is_set():
                closed.set()
                subprocess.run(["rabbitmqctl", "-q", "close_all_connections", "-p", vhost, "chaos test"],
                               check=True, capture_output=True, timeout=60)

        result = run_job(spec, settings, learners=2, connect=lambda name: RabbitBus(settings, name),
                         on_event=on_event, idle_timeout=90)
    assert closed.is_set()
    assert result["status"] == "completed"
    assert result["reconnects"] >= 3, "scheduler, aggregator and learners all had to reconnect"
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))
    assert_matches_reference(result, reference_fedavg(spec))


def test_a_consumer_cancelled_by_the_broker_subscribes_again(tmp_path) -> None:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, retry_initial_s=0.2)
        got: queue.Queue[bytes] = queue.Queue()
        consumer = RabbitBus(settings, "consumer")

        def handle(delivery: Delivery) -> None:
            got.put(delivery.body)
            delivery.ack()

        consumer.consume("fedmq.tasks", handle)
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        assert consumer.wait_ready(WAIT)
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().queue_delete("fedmq.tasks")  # the broker cancels our consumer
        conn.close()
        deadline = time.monotonic() + WAIT
        while consumer.reconnects == 0 or not consumer.wait_ready(0.1):
            assert time.monotonic() < deadline, "the consumer never noticed its cancellation"
            time.sleep(0.1)
        RabbitBus(settings, "producer").publish("fedmq.tasks", b"after cancel")
        assert got.get(timeout=WAIT) == b"after cancel"
        consumer.stop()
        thread.join(WAIT)


def publish_blob(url: str, chunks: list[bytes], size: int, digest: str, count: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare("fedmq.blob.test", durable=True, arguments={"x-expires": 60_000})
    for i, chunk in enumerate(chunks):
        headers = {H_BLOB: "fedmq.blob.test", H_INDEX: i, H_COUNT: count}
        ch.basic_publish("", "fedmq.blob.test", chunk, pika.BasicProperties(headers=headers))
    ch.basic_publish("", "fedmq.aggregator", b"", pika.BasicProperties(headers={
        H_BLOB: "fedmq.blob.test", H_COUNT: count, H_SIZE: size, H_DIGEST: digest}))
    conn.close()


def broken_blob_reason(tmp_path, chunks: list[bytes], size: int, digest: str, count: int) -> str:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path)
        bus = RabbitBus(settings, "aggregator")
        handled: queue.Queue[Delivery] = queue.Queue()
        bus.consume("fedmq.aggregator", handled.put)
        thread = threading.Thread(target=bus.run, daemon=True)
        thread.start()
        assert bus.wait_ready(WAIT)
        publish_blob(url, chunks, size, digest, count)
        deadline = time.monotonic() + WAIT
        while not (dead := dead_letters(url)) and time.monotonic() < deadline:
            time.sleep(0.2)
        bus.stop()
        thread.join(WAIT)
    assert handled.empty(), "a broken blob must never reach the handler"
    assert len(dead) == 1
    return str(dead[0][0]["x-fedmq-reason"])


def test_a_blob_whose_chunks_never_all_arrive_is_dead_lettered(tmp_path) -> None:
    data = b"x" * 100
    reason = broken_blob_reason(tmp_path, [data[:50]], 100, hashlib.sha256(data).hexdigest(), 2)
    assert reason == "blob: only 1 of 2 chunks arrived"


def test_a_blob_with_a_wrong_digest_is_dead_lettered(tmp_path) -> None:
    data = b"x" * 100
    wrong = hashlib.sha256(b"other").hexdigest()
    reason = broken_blob_reason(tmp_path, [data[:50], data[50:]], 100, wrong, 2)
    assert reason == "blob: digest mismatch"


def test_a_blob_larger_than_the_limit_is_refused_before_it_is_read(tmp_path) -> None:
    reason = broken_blob_reason(tmp_path, [b"x"], 10 * 1024**3, "00", 2560)
    assert reason.startswith("blob: 10737418240 bytes is over the")


def test_an_envelope_naming_a_missing_blob_is_dead_lettered_without_reconnecting(tmp_path) -> None:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path)
        bus = RabbitBus(settings, "aggregator")
        bus.consume("fedmq.aggregator", lambda d: d.ack())
        thread = threading.Thread(target=bus.run, daemon=True)
        thread.start()
        assert bus.wait_ready(WAIT)
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().basic_publish("", "fedmq.aggregator", b"", pika.BasicProperties(headers={
            H_BLOB: "fedmq.blob.never-made", H_COUNT: 1, H_SIZE: 10, H_DIGEST: "00"}))
        conn.close()
        deadline = time.monotonic() + WAIT
        while not (dead := dead_letters(url)) and time.monotonic() < deadline:
            time.sleep(0.2)
        bus.stop()
        thread.join(WAIT)
    assert bus.reconnects == 0
    assert [str(h["x-fedmq-reason"]).split(":")[:2] for h, _ in dead] == [["blob", " blob queue unavailable"]]


def announce_blobs_that_never_come(url: str) -> int:
    """Envelopes whose chunks never come: blob queues empty or short, and one never made."""
    frame, size = 64 * 1024, 400 * 1024**2  # a zero-byte envelope claiming 400 MB
    count = size // frame
    blobs = {"fedmq.blob.empty": 0, "fedmq.blob.one": 1, "fedmq.blob.most": 3, "fedmq.blob.none": None}
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    for name, chunks in blobs.items():
        claim = (size, count) if chunks != 3 else (4 * frame, 4)  # the last chunk of four lost
        if chunks is not None:
            ch.queue_declare(name, durable=True, arguments={"x-expires": 600_000})
            for i in range(chunks):
                ch.basic_publish("", name, b"c" * frame, pika.BasicProperties(
                    headers={H_BLOB: name, H_INDEX: i, H_COUNT: claim[1]}))
        ch.basic_publish("", "fedmq.aggregator", b"", pika.BasicProperties(headers={
            H_BLOB: name, H_COUNT: claim[1], H_SIZE: claim[0], H_DIGEST: "00"}))
    ch.queue_declare("fedmq.blob.two", durable=True, arguments={"x-expires": 600_000})
    ch.basic_publish("", "fedmq.aggregator", b"", pika.BasicProperties(headers={
        H_BLOB: "fedmq.blob.two", H_COUNT: count, H_SIZE: size, H_DIGEST: "00"}))
    conn.close()
    return len(blobs) + 1


def test_envelopes_whose_chunks_never_come_are_refused_at_once_while_the_job_goes_on(
    tmp_path: Path, embedded_runs: EmbeddedRuns, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fedmq used to wait this long per such envelope, holding the aggregator's bus thread.
    monkeypatch.setenv("FEDMQ_BLOB_WAIT_S", "3600")
    spec = small_job(rounds=4)
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=64 * 1024)
        sent: list[int] = []

        def on_event(event: JobEvent) -> None:
            if event.kind == "round_started" and event.round == 2 and not sent:
                sent.append(announce_blobs_that_never_come(url))

        result = run_job(spec, settings, connect=lambda name: RabbitBus(settings, name),
                         on_event=on_event, idle_timeout=60)
        dead = dead_letters(url)
    assert sent == [5]
    assert result["status"] == "completed"
    assert result["dead_letters"] == {"blob": 5}
    assert sorted(str(h["x-fedmq-reason"]).split(":")[0] for h, _ in dead) == ["blob"] * 5
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))
