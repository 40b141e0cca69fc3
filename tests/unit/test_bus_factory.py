"""The bus factory: the transport FEDMQ_BROKER_URL names; RabbitMQ buses named for their service,
in-memory ones on one shared broker, refused to a process alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from fedmq.common.bus.base import Delivery
from fedmq.common.bus.factory import MemoryBuses, RabbitBuses, bus_of_process, buses
from fedmq.common.bus.memory import MemoryBus
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.errors import ConfigError
from fedmq.common.settings import Settings
from fedmq.services.cli.main import app


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


def test_the_settings_pick_the_transport_by_the_broker_url(tmp_path: Path) -> None:
    assert isinstance(buses(Settings(state_dir=tmp_path)), RabbitBuses)
    memory = Settings(state_dir=tmp_path, broker_url="memory://")
    assert memory.in_memory and memory.broker_urls == ("memory://",)
    assert isinstance(buses(memory), MemoryBuses)
    assert isinstance(buses(memory).connect("scheduler"), MemoryBus)


def test_a_process_alone_is_refused_an_in_memory_broker_with_what_to_do(tmp_path: Path) -> None:
    says = r"scheduler alone would reach no one.*amqp://.*fedmq run --services"
    with pytest.raises(ConfigError, match=says):
        bus_of_process(Settings(state_dir=tmp_path, broker_url="memory://"), "scheduler")
    bus = bus_of_process(Settings(state_dir=tmp_path), "learner-0")
    assert isinstance(bus, RabbitBus) and bus.name == "learner-0"


@pytest.mark.parametrize(("url", "says"), [
    ("memory://, amqp://guest@127.0.0.1/", "stands alone"),
    ("redis://127.0.0.1/", "must start with amqp:// or amqps:// (or be memory://)"),
])
def test_a_broker_url_that_names_no_transport_is_refused(tmp_path: Path, url: str, says: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(says)):
        Settings(state_dir=tmp_path, broker_url=url)


def test_a_password_for_the_in_memory_broker_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="memory://, where no one logs in"):
        Settings(state_dir=tmp_path, broker_url="memory://", broker_password="secret")


def test_the_cli_says_the_in_memory_broker_is_no_broker_to_ask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDMQ_BROKER_URL", "memory://")
    monkeypatch.setenv("FEDMQ_STATE_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 2, result.output
    assert "would reach no one" in result.output and "Traceback" not in result.output


def test_tls_files_with_the_in_memory_broker_are_refused_with_what_to_do(tmp_path: Path) -> None:
    cert = tmp_path / "ca.pem"
    cert.write_text("not read")
    with pytest.raises(ValidationError, match="memory://, which no connection reaches: unset them"):
        Settings(state_dir=tmp_path, broker_url="memory://", tls_ca_file=cert)


def test_the_python_api_runs_the_services_in_process_for_the_in_memory_broker(tmp_path: Path) -> None:
    import fedmq

    runner = fedmq.Runner("memory://", state_dir=tmp_path)
    assert (runner.remote_mode, runner.services) == (False, True)
