"""Several broker addresses: a bus skips one that does not answer and moves on when it loses one."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from fedmq.common.bus.base import Delivery
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.settings import Settings
from tests.integration.test_bus_contract import WAIT
from tests.rabbit import fresh_vhost

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker

DEAD = "amqp://guest:guest@127.0.0.1:1/%2F"  # nothing listens on port 1: refused at once


def close_all_connections(url: str) -> None:
    vhost = urlsplit(url).path.lstrip("/")
    subprocess.run(["rabbitmqctl", "-q", "close_all_connections", "-p", vhost, "failover test"],
                   check=True, capture_output=True, timeout=60)


def reconnected(bus: RabbitBus, times: int) -> None:
    deadline = time.monotonic() + WAIT
    while bus.reconnects < times or not bus.wait_ready(0.1):
        assert time.monotonic() < deadline, f"no reconnect #{times} within {WAIT} s"


def test_a_lost_connection_moves_to_the_next_address_skipping_a_dead_one(tmp_path: Path) -> None:
    with fresh_vhost() as url:
        # Three "nodes": the broker, a dead address, the broker again.
        settings = Settings(broker_url=f"{url},{DEAD},{url}", state_dir=tmp_path, retry_initial_s=0.2)
        got: queue.Queue[bytes] = queue.Queue()
        consumer = RabbitBus(settings, "consumer")

        def handle(delivery: Delivery) -> None:
            got.put(delivery.body)
            delivery.ack()

        consumer.consume("fedmq.tasks", handle)
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        assert consumer.wait_ready(WAIT)
        assert consumer.node == 0
        close_all_connections(url)
        reconnected(consumer, 1)
        assert consumer.node == 2, "after losing node 0 it tries node 1 (dead), then node 2"
        close_all_connections(url)
        reconnected(consumer, 2)
        assert consumer.node == 0, "after node 2 it wraps around to node 0"

        producer = RabbitBus(Settings(broker_url=f"{DEAD},{url}", state_dir=tmp_path), "producer")
        producer.publish("fedmq.tasks", b"through the second address")
        assert producer.node == 1
        assert got.get(timeout=WAIT) == b"through the second address"
        consumer.stop()
        thread.join(WAIT)
