"""The bus factory: RabbitMQ buses named for their service, in-memory ones on one shared broker."""

from __future__ import annotations

from pathlib import Path

from fedmq.common.bus.base import Delivery
from fedmq.common.bus.factory import MemoryBuses, RabbitBuses
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.settings import Settings


def test_a_rabbitmq_bus_is_named_for_its_service_and_opens_nothing_until_it_connects(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path, broker_url="amqp://nobody:nothing@127.0.0.1:1/none")
    bus = RabbitBuses(settings).connect("aggregator")
    assert isinstance(bus, RabbitBus)
    assert (bus.name, bus.settings) == ("aggregator", settings)


def test_in_memory_buses_share_one_broker_built_from_the_settings_and_publish_as_their_service(
    tmp_path: Path,
) -> None:
    settings = Settings(state_dir=tmp_path, frame_bytes=65536, fsync=False)
    buses = MemoryBuses(settings)
    assert (buses.broker.frame_bytes, buses.broker.fsync) == (65536, False)
    consumer, learner = buses.connect("aggregator"), buses.connect("learner-3")
    got: list[tuple[bytes, str | None]] = []

    def handle(delivery: Delivery) -> None:
        got.append((delivery.body, delivery.user_id))
        delivery.ack()
        consumer.stop()

    consumer.consume("work", handle)
    learner.publish("work", b"update")
    consumer.run()  # handles what was delivered, then returns
    assert got == [(b"update", "learner")]
    assert buses.connect("fedmq-cli").user == "cli"
