"""Where a process's buses come from: the one place that names the transports.

    buses(settings)                       the transport FEDMQ_BROKER_URL names:
      RabbitBuses(settings).connect(name)   amqp(s)://: a RabbitBus, its own connection to the
                                            broker, as the broker user the URL logs in as
      MemoryBuses(settings).connect(name)   memory://: a MemoryBus on this process's one in-memory
                                            broker (frame size and fsync from the settings),
                                            publishing as the broker user its service has when
                                            deployed (user_of)
    bus_of_process(settings, name)        the bus of a process that is one party alone (a service,
                                          the CLI): memory:// is refused there, it would reach no one

A service process (common/lifecycle.py) and the CLI (services/cli/remote.py) take theirs from
bus_of_process; the embedded cluster (services/cli/embedded.py, which `fedmq run --services` and
the Python API's services mode run) puts every service in one process on MemoryBuses, unless it is
handed a `connect` of another (a test's RabbitMQ).
"""

from __future__ import annotations

from typing import Protocol

from fedmq.common.bus.base import Bus
from fedmq.common.bus.memory import MemoryBroker, MemoryBus
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.errors import ConfigError
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


def buses(settings: Settings) -> Buses:
    """The buses of the transport FEDMQ_BROKER_URL names: in memory for memory://, else RabbitMQ."""
    return MemoryBuses(settings) if settings.in_memory else RabbitBuses(settings)


def bus_of_process(settings: Settings, name: str) -> RabbitBus:
    """The bus of a process that is one party alone (a service, the CLI), not yet connected: its
    connection to RabbitMQ. ConfigError for memory://, whose broker would hold this process alone."""
    if settings.in_memory:
        raise ConfigError(
            f"FEDMQ_BROKER_URL is memory://, a broker inside one process: {name} alone would reach no "
            "one. Give the broker's amqp:// URL, or run every service in one process with "
            "`fedmq run --services`"
        )
    bus = buses(settings).connect(name)
    assert isinstance(bus, RabbitBus), "memory:// was refused above"
    return bus
