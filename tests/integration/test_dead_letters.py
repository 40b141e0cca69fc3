"""fedmq.dead is bounded by count, bytes and age; a dead letter keeps its reason when its body is dropped."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pika
import pytest

from fedmq.common.bus import topology
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.errors import BrokerUnavailable
from fedmq.common.settings import Settings
from tests.integration.test_bus_contract import WAIT
from tests.rabbit import dead_letters, fresh_vhost

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker

BODIES = [bytes([65 + i]) * 1000 for i in range(4)] + [b"z" * 10_000]  # the last over the body limit


def reject_all(settings: Settings, bodies: list[bytes]) -> None:
    """Publish `bodies` to fedmq.tasks, each rejected by a consumer; return once all are dead letters."""
    bus = RabbitBus(settings, "rejecter")
    done = threading.Semaphore(0)
    bus.on_dead_letter = lambda reason: done.release()  # called once the dead letter is confirmed
    bus.consume(topology.TASKS, lambda d: d.reject(f"refused: {len(d.body)} bytes"))
    thread = threading.Thread(target=bus.run, daemon=True)
    thread.start()
    try:
        assert bus.wait_ready(WAIT)
        for body in bodies:  # one at a time: dead letters in this order
            bus.publish(topology.TASKS, body)
            assert done.acquire(timeout=WAIT), "a rejected message never reached fedmq.dead"
    finally:
        bus.stop()
        thread.join(WAIT)


@pytest.mark.parametrize("bound", [{"dead_letter_max_count": 3}, {"dead_letter_max_bytes": 2500}])
def test_dead_letters_past_a_bound_drop_the_oldest_and_a_large_body_keeps_its_reason(
    tmp_path: Path, bound: dict[str, Any]
) -> None:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, dead_letter_body_bytes=1024, **bound)
        reject_all(settings, BODIES)
        dead = dead_letters(url)
    # 3 kept by count; by bytes, 2 x 1000 of bodies and the large one's empty body.
    assert [body for _, body in dead] == [BODIES[2], BODIES[3], b""]
    assert [h["x-fedmq-reason"] for h, _ in dead] == [
        "refused: 1000 bytes", "refused: 1000 bytes", "refused: 10000 bytes"
    ]
    assert dead[-1][0]["x-fedmq-dropped-bytes"] == 10_000 and "x-fedmq-dropped-bytes" not in dead[0][0]


def test_dead_letters_expire_after_their_time(tmp_path: Path) -> None:
    with fresh_vhost() as url:
        reject_all(Settings(broker_url=url, state_dir=tmp_path, dead_letter_ttl_s=1), [b"old"])
        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()

        def left() -> int:
            return int(ch.queue_declare(topology.DEAD_LETTERS, passive=True).method.message_count)

        deadline = time.monotonic() + WAIT
        while left() and time.monotonic() < deadline:
            conn.sleep(0.1)
        remaining = left()
        conn.close()
    assert remaining == 0


@pytest.mark.parametrize("earlier", ["unbounded", "other count"])
def test_a_dead_letter_queue_declared_with_other_bounds_is_one_clear_error(
    tmp_path: Path, earlier: str
) -> None:
    settings = Settings(state_dir=tmp_path)
    arguments: dict[str, Any] = {"x-queue-type": "quorum"}  # as a fedmq that did not bound it
    if earlier == "other count":
        arguments = {**topology.dead_letter_arguments(settings), "x-max-length": 5}
    with fresh_vhost() as url:
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().queue_declare(topology.DEAD_LETTERS, durable=True, arguments=arguments)
        conn.close()
        with pytest.raises(BrokerUnavailable) as refused:
            RabbitBus(settings.model_copy(update={"broker_url": url}), "scheduler").connect()
    message = str(refused.value)
    vhost = urlsplit(url).path.lstrip("/")
    assert "queue fedmq.dead exists with another x-" in message
    assert f"rabbitmqctl delete_queue -p {vhost} fedmq.dead" in message
    if earlier == "unbounded":  # no value a setting could match
        assert "set FEDMQ_" not in message
    else:
        assert "another x-max-length than this service asks for" in message
        assert "set FEDMQ_DEAD_LETTER_MAX_COUNT to the value the queue has" in message


def test_a_delivery_is_dead_lettered_whole_under_the_body_limit(tmp_path: Path) -> None:
    with fresh_vhost() as url:
        reject_all(Settings(broker_url=url, state_dir=tmp_path), [b"q" * 60_000])
        dead = dead_letters(url)
    assert [len(body) for _, body in dead] == [60_000]
