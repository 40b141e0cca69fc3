"""Every integration scenario runs on the in-memory bus and on a real RabbitMQ."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fedmq.common.bus.base import Bus
from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.settings import Settings
from tests.rabbit import dead_letters, fresh_vhost


@dataclass
class Transport:
    """How a scenario gets its buses, and how it reads what was dead-lettered."""

    name: str
    settings: Settings
    connect: Callable[[str], Bus]
    broker: MemoryBroker | None = None
    url: str = ""
    made: list[Bus] = field(default_factory=list)

    def dead(self) -> list[tuple[str, bytes]]:
        """(reason, body) of each dead letter so far."""
        if self.broker is not None:
            return [(d.reason, d.body) for d in self.broker.dead_letters]
        return [(str(h.get("x-fedmq-reason", h.get("x-first-death-reason", ""))), b)
                for h, b in dead_letters(self.url)]


@pytest.fixture(params=["memory", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Transport]:
    state = tmp_path / "state"
    if request.param == "memory":
        settings = Settings(state_dir=state, log_format="json")
        broker = MemoryBroker(frame_bytes=settings.frame_bytes)
        yield Transport("memory", settings, lambda name: broker.connect(), broker=broker)
        return
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=state, log_format="json", frame_bytes=64 * 1024)
        yield Transport("rabbitmq", settings, lambda name: RabbitBus(settings, name), url=url)
