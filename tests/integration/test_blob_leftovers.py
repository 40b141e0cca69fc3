"""Blob queues do not outlive their use: a sender that fails removes its own, an orphan expires in minutes."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pika
import pytest

from fedmq.common.bus import topology
from fedmq.common.bus.base import Delivery
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.settings import Settings
from tests.integration.test_bus_contract import WAIT
from tests.rabbit import close_connections, fresh_vhost

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker

FRAME = 64 * 1024


def blob_queues(url: str) -> dict[str, dict[str, Any]]:
    """The vhost's blob queues, with their arguments."""
    vhost = urlsplit(url).path.lstrip("/")
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name", "arguments", "--formatter", "json"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    return {
        q["name"]: {name: value for name, _, value in q["arguments"]}
        for q in json.loads(out) if q["name"].startswith("fedmq.blob.")
    }


@contextmanager
def running(settings: Settings, name: str) -> Iterator[RabbitBus]:
    bus = RabbitBus(settings, name)
    thread = threading.Thread(target=bus.run, name=name, daemon=True)
    thread.start()
    assert bus.wait_ready(WAIT)
    try:
        yield bus
    finally:
        bus.stop()
        thread.join(WAIT)


def test_a_sender_cut_off_mid_blob_deletes_its_blob_queue_once_reconnected(tmp_path: Path) -> None:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=FRAME, retry_initial_s=0.2)
        with running(settings, "sender") as bus:
            chunks = 0

            def close_after_three_chunks(direction: str, size: int) -> None:
                nonlocal chunks
                chunks += direction == "published"
                if chunks == 3:  # on the bus thread, between two chunks of the blob
                    close_connections(url, "closed mid-blob by the test")

            bus.on_traffic = close_after_three_chunks
            with pytest.raises(ConnectionError):
                bus.publish(topology.TASKS, b"x" * 20 * FRAME)
            deadline = time.monotonic() + WAIT
            while not (bus.reconnects and bus.wait_ready(0.1)):
                assert time.monotonic() < deadline, "the sender never reconnected"
            left = blob_queues(url)
    assert chunks == 3
    assert left == {}, "the blob queue of the failed send outlived it"


def test_a_large_reply_to_an_asker_that_is_gone_leaves_no_blob_queue(tmp_path: Path) -> None:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=FRAME)
        answered = threading.Event()
        with running(settings, "server") as bus:

            def answer(delivery: Delivery) -> None:
                bus.reply(delivery, b"r" * 5 * FRAME)  # as a model: a blob
                delivery.ack()
                answered.set()

            bus.consume(topology.MODEL, answer)
            conn = pika.BlockingConnection(pika.URLParameters(url))
            # The asker's reply queue died with its connection (a restart, a forced close).
            conn.channel().basic_publish("", topology.MODEL, b"get", pika.BasicProperties(
                reply_to="amq.gen-asker-that-is-gone", correlation_id="1"))
            conn.close()
            assert answered.wait(WAIT)
            left = blob_queues(url)
    assert left == {}


def test_a_blob_queue_nobody_reads_expires_after_the_setting(tmp_path: Path) -> None:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=FRAME, blob_expiry_s=90)
        with running(settings, "sender") as bus:
            bus.publish(topology.TASKS, b"x" * 3 * FRAME)  # its envelope waits; nobody reads it
        [arguments] = blob_queues(url).values()
    # The broker deletes it once unused this long: a sender that died leaves nothing for long.
    assert arguments["x-expires"] == 90_000
    assert Settings(_env_file=None).blob_expiry_s == 600  # minutes, not the hour it was
