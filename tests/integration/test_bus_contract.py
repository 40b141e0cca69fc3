"""The Bus contract, checked the same way on the in-memory bus and on RabbitMQ."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.codec import packb, packb_parts
from tests.integration.conftest import Transport

WAIT = 20.0


@contextmanager
def running(transport: Transport, name: str) -> Iterator[Bus]:
    bus = transport.connect(name)
    thread = threading.Thread(target=bus.run, name=name, daemon=True)
    thread.start()
    assert bus.wait_ready(WAIT)
    try:
        yield bus
    finally:
        bus.stop()
        thread.join(WAIT)


def collector(into: queue.Queue[Delivery], ack: bool = True) -> Callable[[Delivery], None]:
    def handle(delivery: Delivery) -> None:
        into.put(delivery)
        if ack:
            delivery.ack()

    return handle


def test_a_published_message_reaches_a_consumer_once(transport: Transport) -> None:
    got: queue.Queue[Delivery] = queue.Queue()
    with running(transport, "consumer") as consumer, running(transport, "producer") as producer:
        consumer.consume("fedmq.tasks", collector(got))
        producer.publish("fedmq.tasks", b"hello", headers={"k": "v"})
        delivery = got.get(timeout=WAIT)
        assert delivery.body == b"hello"
        assert delivery.headers.get("k") == "v"
        assert not delivery.redelivered
        producer.publish("fedmq.tasks", b"second")
        assert got.get(timeout=WAIT).body == b"second"
    assert got.empty()


def test_a_rejected_message_is_dead_lettered_with_its_reason(transport: Transport) -> None:
    rejected = threading.Event()

    def reject(delivery: Delivery) -> None:
        delivery.reject("wrong_shape: layer.0")
        rejected.set()

    counted: list[str] = []
    with running(transport, "consumer") as consumer:
        consumer.on_dead_letter = counted.append
        consumer.consume("fedmq.aggregator", reject)
        consumer.publish("fedmq.aggregator", b"bad update")
        assert rejected.wait(WAIT)
    assert ("wrong_shape: layer.0", b"bad update") in transport.dead()
    assert counted == ["wrong_shape: layer.0"], "the metrics hook sees every dead letter"


@pytest.mark.parametrize("error", [ValueError("bug"), FileNotFoundError("no such update file")])
def test_a_handler_that_raises_is_dead_lettered_and_the_consumer_goes_on(
    transport: Transport, error: Exception
) -> None:
    got: queue.Queue[Delivery] = queue.Queue()

    def handle(delivery: Delivery) -> None:
        if delivery.body == b"boom":
            raise error
        got.put(delivery)
        delivery.ack()

    with running(transport, "consumer") as consumer:
        consumer.consume("fedmq.scheduler", handle)
        consumer.publish("fedmq.scheduler", b"boom")
        consumer.publish("fedmq.scheduler", b"fine")
        assert got.get(timeout=WAIT).body == b"fine"
        assert getattr(consumer, "reconnects", 0) == 0, "a handler's own error is not a lost connection"
    assert [r for r, b in transport.dead() if b == b"boom"] == [f"handler_error: {type(error).__name__}"]


def test_an_unacked_message_is_redelivered_when_its_consumer_goes_away(transport: Transport) -> None:
    first: queue.Queue[Delivery] = queue.Queue()
    with running(transport, "producer") as producer:
        with running(transport, "dies") as dies:
            dies.consume("fedmq.tasks", collector(first, ack=False))
            producer.publish("fedmq.tasks", b"task")
            assert first.get(timeout=WAIT).body == b"task"
        second: queue.Queue[Delivery] = queue.Queue()
        with running(transport, "survivor") as survivor:
            survivor.consume("fedmq.tasks", collector(second))
            again = second.get(timeout=WAIT)
    assert again.body == b"task"
    assert again.redelivered


def test_ack_from_a_worker_thread_is_honoured(transport: Transport) -> None:
    got: queue.Queue[Delivery] = queue.Queue()
    with running(transport, "consumer") as consumer:
        def handle(delivery: Delivery) -> None:
            def take_and_ack() -> None:
                got.put(delivery)
                delivery.ack()

            threading.Thread(target=take_and_ack).start()

        consumer.consume("fedmq.tasks", handle, prefetch=1)
        for body in (b"1", b"2", b"3"):
            consumer.publish("fedmq.tasks", body)
        assert [got.get(timeout=WAIT).body for _ in range(3)] == [b"1", b"2", b"3"]


def test_request_and_reply_carry_a_message_larger_than_the_frame(transport: Transport) -> None:
    big = os.urandom(transport.settings.frame_bytes * 3 + 17)

    def answer(delivery: Delivery) -> None:
        server.reply(delivery, delivery.body[::-1] + big)
        delivery.ack()

    with running(transport, "server") as server, running(transport, "client") as client:
        server.consume("fedmq.model", answer)
        reply = client.request("fedmq.model", big, timeout=WAIT)
    assert reply == big[::-1] + big


def test_a_large_reply_comes_as_a_file_of_its_bytes_and_a_small_one_in_memory(
    transport: Transport, tmp_path: Path
) -> None:
    """request_large: a reply in chunks is written to a new file in the spool, not held twice in
    memory (in memory nothing comes in chunks: bytes there); a reply within a frame is bytes."""
    big = os.urandom(transport.settings.frame_bytes * 3 + 17)
    spool = tmp_path / "spool"
    asked: list[int] = []

    def answer(delivery: Delivery) -> None:
        server.reply(delivery, big if delivery.body == b"big" else b"small")
        delivery.ack()

    def folder() -> Path:
        asked.append(1)
        return spool

    with running(transport, "server") as server, running(transport, "client") as client:
        server.consume("fedmq.model", answer)
        small = client.request_large("fedmq.model", b"small?", timeout=WAIT, spool=folder)
        large = client.request_large("fedmq.model", b"big", timeout=WAIT, spool=folder)
    assert small == b"small"
    if transport.name == "memory":
        assert large == big and not asked
        return
    assert isinstance(large, Path) and large.parent == spool
    assert large.read_bytes() == big
    assert list(spool.iterdir()) == [large], "one file, the caller's to delete"


def test_a_requeued_large_message_comes_back_whole(transport: Transport) -> None:
    big = os.urandom(transport.settings.frame_bytes * 3 + 5)
    got: queue.Queue[Delivery] = queue.Queue()

    def handle(delivery: Delivery) -> None:
        got.put(delivery)
        if delivery.redelivered:
            delivery.ack()
        else:
            delivery.requeue()

    with running(transport, "consumer") as consumer:
        consumer.consume("fedmq.aggregator", handle)
        consumer.publish("fedmq.aggregator", big)
        first, second = got.get(timeout=WAIT), got.get(timeout=WAIT)
    assert bytes(first.body) == bytes(second.body) == big
    assert second.redelivered


def test_a_large_message_to_a_consumer_with_a_spool_comes_in_a_file_gone_once_settled(
    transport: Transport, tmp_path: Path
) -> None:
    """consume(spool=): a message over a frame is received into a file there (body empty), which
    is removed once the message is settled unless the handler moved it; a small one is bytes. An
    encoding published in parts comes whole, owned (the in-memory bus reads it on the consumer's
    thread) or not."""
    spool, kept = tmp_path / "spool", tmp_path / "kept.msg"
    tensor = torch.arange(transport.settings.frame_bytes // 2, dtype=torch.float32)  # two frames
    got: queue.Queue[tuple[bytes, Path | None, bytes]] = queue.Queue()

    def handle(delivery: Delivery) -> None:
        path = delivery.body_path
        got.put((delivery.body, path, path.read_bytes() if path is not None else b""))
        if path is not None and delivery.headers.get("keep"):
            path.rename(kept)
        delivery.ack()

    with running(transport, "consumer") as consumer, running(transport, "producer") as producer:
        consumer.consume("fedmq.aggregator", handle, spool=spool)
        whole = packb({"weights": {"t": tensor}})
        producer.publish("fedmq.aggregator", packb_parts({"weights": {"t": tensor}}), headers={"keep": 1})
        owned = packb_parts({"weights": {"t": tensor}})
        owned.owned = True
        producer.publish("fedmq.aggregator", owned)
        producer.publish("fedmq.aggregator", b"small")
        arrived = [got.get(timeout=WAIT) for _ in range(3)]
    for body, path, data in arrived[:2]:
        assert body == b"" and path is not None and path.parent == spool and data == whole
    assert arrived[2] == (b"small", None, b"")
    assert kept.read_bytes() == whole
    assert not spool.exists() or not list(spool.iterdir()), "the file not moved away is removed"


def test_a_large_message_crosses_in_one_piece(transport: Transport) -> None:
    big = os.urandom(transport.settings.frame_bytes * 5 + 1)
    got: queue.Queue[Delivery] = queue.Queue()
    with running(transport, "consumer") as consumer, running(transport, "producer") as producer:
        consumer.consume("fedmq.aggregator", collector(got))
        producer.publish("fedmq.aggregator", big)
        assert bytes(got.get(timeout=WAIT).body) == big


def test_messages_published_together_arrive_in_order_small_and_large(transport: Transport) -> None:
    big = os.urandom(transport.settings.frame_bytes + 1)
    tasks: queue.Queue[Delivery] = queue.Queue()
    updates: queue.Queue[Delivery] = queue.Queue()
    with running(transport, "consumer") as consumer, running(transport, "producer") as producer:
        consumer.consume("fedmq.tasks", collector(tasks))
        consumer.consume("fedmq.aggregator", collector(updates))
        tasks_sent = [("fedmq.tasks", b"t%d" % i) for i in range(12)]
        producer.publish_all([("fedmq.aggregator", b"open"), *tasks_sent])
        producer.publish_all([("fedmq.aggregator", b"after"), ("fedmq.aggregator", big)])  # a blob among them
        assert [tasks.get(timeout=WAIT).body for _ in range(12)] == [b"t%d" % i for i in range(12)]
        assert [bytes(updates.get(timeout=WAIT).body) for _ in range(3)] == [b"open", b"after", big]
        producer.publish_all([])
    assert tasks.empty() and updates.empty()


@pytest.mark.rabbitmq
def test_a_message_no_queue_takes_fails_its_batch_the_others_are_sent(tmp_path: Path) -> None:
    import pika
    import pika.exceptions

    from fedmq.common.bus.rabbitmq import RabbitBus
    from fedmq.common.settings import Settings
    from tests.rabbit import fresh_vhost

    got: queue.Queue[Delivery] = queue.Queue()
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, log_format="json")
        transport = Transport("rabbitmq", settings, lambda name: RabbitBus(settings, name), url=url)
        with running(transport, "consumer") as consumer, running(transport, "producer") as producer:
            consumer.consume("fedmq.aggregator", collector(got))
            admin = pika.BlockingConnection(pika.URLParameters(url))
            admin.channel().queue_delete("fedmq.tasks")  # its exchange now routes a task nowhere
            admin.close()
            with pytest.raises(pika.exceptions.UnroutableError) as failed:
                producer.publish_all(
                    [("fedmq.aggregator", b"a"), ("fedmq.tasks", b"lost"), ("fedmq.aggregator", b"b")]
                )
            assert [m.body for m in failed.value.messages] == [b"lost"]
            assert [got.get(timeout=WAIT).body for _ in range(2)] == [b"a", b"b"]
            producer.publish_all([("fedmq.aggregator", b"c"), ("fedmq.aggregator", b"d")])  # goes on
            assert [got.get(timeout=WAIT).body for _ in range(2)] == [b"c", b"d"]


def test_events_reach_every_matching_subscriber(transport: Transport) -> None:
    seen: queue.Queue[tuple[str, bytes]] = queue.Queue()
    with running(transport, "a") as a, running(transport, "b") as b:
        a.subscribe("job.*", lambda body: seen.put(("a", body)))
        b.subscribe("job.one", lambda body: seen.put(("b", body)))
        a.publish_event("job.one", b"e1")
        a.publish_event("job.two", b"e2")
        got = sorted(seen.get(timeout=WAIT) for _ in range(3))
    assert got == [("a", b"e1"), ("a", b"e2"), ("b", b"e1")]


def test_timers_run_on_the_bus_thread(transport: Transport) -> None:
    ran: queue.Queue[str] = queue.Queue()
    with running(transport, "timers") as bus:
        bus.call_later(0.05, lambda: ran.put(threading.current_thread().name))
        cancelled = bus.call_later(0.05, lambda: ran.put("cancelled"))
        cancelled.cancel()
        assert ran.get(timeout=WAIT) == "timers"
    assert ran.empty()


def test_work_left_for_when_idle_runs_once_the_deliveries_that_came_are_handled(transport: Transport) -> None:
    # The aggregator's group commit: each update is handled as it comes, and what they share (the
    # fsync, the reply, the acks) is done once the deliveries that have arrived are all handled.
    seen: list[str] = []
    held: list[Delivery] = []
    started, release, batches = threading.Event(), threading.Event(), queue.Queue[list[str]]()

    def settle() -> None:
        seen.append("idle")
        batches.put(list(seen))
        seen.clear()
        for delivery in held:
            delivery.ack()
        held.clear()

    def handle(delivery: Delivery) -> None:
        if not held:
            bus.call_when_idle(settle)
        held.append(delivery)
        seen.append(delivery.body.decode())
        if delivery.body == b"m0":
            started.set()
            assert release.wait(WAIT)  # the others arrive meanwhile

    with running(transport, "consumer") as bus, running(transport, "producer") as producer:
        bus.consume("fedmq.tasks", handle, prefetch=8)
        producer.publish("fedmq.tasks", b"m0")
        assert started.wait(WAIT)
        producer.publish_all([("fedmq.tasks", f"m{i}".encode()) for i in range(1, 5)])
        time.sleep(0.5)  # long enough for the broker to push them to the consumer
        release.set()
        assert batches.get(timeout=WAIT) == ["m0", "m1", "m2", "m3", "m4", "idle"]
        producer.publish("fedmq.tasks", b"m5")
        assert batches.get(timeout=WAIT) == ["m5", "idle"]
