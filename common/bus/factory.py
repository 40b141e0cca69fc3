"""Where a process's buses come from: the one place that names the transports.

    RabbitBuses(settings).connect(name)   a RabbitBus: its own connection to FEDMQ_BROKER_URL,
                                          as the broker user the URL logs in as
    MemoryBuses(settings).connect(name)   a MemoryBus on this process's one in-memory broker
                                          (frame size and fsync from the settings), publishing as
                                          the broker user its service has when deployed (user_of)

A service process (common/lifecycle.py) and the CLI (services/cli/remote.py) take theirs from
RabbitBuses; the embedded cluster (services/cli/embedded.py, which the Python API's services mode
runs too) from MemoryBuses, unless it is handed a `connect` of another (a test's RabbitMQ).
"""

from __future__ import annotations

from typing import Protocol

from fedmq.common.bus.base import Bus
from fedmq.common.bus.memory import MemoryBroker, MemoryBus
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.settings import Settings

ROLES = ("scheduler", "aggregator", "learner")  # the services' broker users; anyone else is the CLI's


def user_of(name: str) -> str:
    """The broker user a bus named `name` publishes as: its service's (`learner-2`: learner), as
    deployed, else the CLI's."""
    role = name.split("-", 1)[0]
    return role if role in ROLES else "cli"


class Buses(Protocol):
    """Makes the buses of one process, by name."""

    def connect(self, name: str) -> Bus: ...


class RabbitBuses:
    """Each bus its own connection to the settings' RabbitMQ; nothing opens before the bus connects."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def connect(self, name: str) -> RabbitBus:
        return RabbitBus(self.settings, name=name)


class MemoryBuses:
    """Every bus on one in-memory broker (`broker`: its queues and dead letters, for a look inside)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.broker = MemoryBroker(frame_bytes=settings.frame_bytes, fsync=settings.fsync)

    def connect(self, name: str) -> MemoryBus:
        return self.broker.connect(user=user_of(name))

