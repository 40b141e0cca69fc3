"""Embedded mode: scheduler, aggregator and learners as threads on one in-memory bus.

This module is the composition root for one process; `fedmq <service>` is the
composition root for separate processes. Same services, same handlers.
"""

from __future__ import annotations

import threading
from types import TracebackType

from common.bus.memory import MemoryBroker, MemoryBus
from common.settings import Settings
from services.aggregator.service import AggregatorService
from services.learner.service import LearnerService
from services.scheduler.service import SchedulerService


class EmbeddedCluster:
    """All services of fedmq in this process; use as a context manager."""

    def __init__(self, settings: Settings, learners: int = 1) -> None:
        self.settings = settings
        self.broker = MemoryBroker()
        self.scheduler = SchedulerService(settings, self.broker.connect())
        self.aggregator = AggregatorService(settings, self.broker.connect())
        self.learners = [
            LearnerService(settings, self.broker.connect(), replica=i) for i in range(learners)
        ]
        self._threads: list[threading.Thread] = []

    def connect(self) -> MemoryBus:
        """A bus for a client of the cluster (the CLI, a test)."""
        return self.broker.connect()

    def __enter__(self) -> EmbeddedCluster:
        for name, service in self._services():
            service.start()
            thread = threading.Thread(target=service.bus.run, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for learner in self.learners:
            learner.shutdown()
        for _, service in self._services():
            service.bus.stop()
        for thread in self._threads:
            thread.join(timeout=10)

    def _services(self) -> list[tuple[str, SchedulerService | AggregatorService | LearnerService]]:
        return [
            ("scheduler", self.scheduler),
            ("aggregator", self.aggregator),
            *[(f"learner-{i}", learner) for i, learner in enumerate(self.learners)],
        ]
