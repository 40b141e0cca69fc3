"""Embedded mode: scheduler, aggregator and learners as threads on one in-memory bus.

This module is the composition root for one process; `fedmq <service>` is the
composition root for separate processes. Same services, same handlers.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import JobEvent, JobSubmit, to_wire
from fedmq.common.settings import Settings
from fedmq.services.aggregator.service import AggregatorService
from fedmq.services.cli.follow import TERMINAL, JobFollower
from fedmq.services.cli.summary import summarize
from fedmq.services.learner.service import LearnerService
from fedmq.services.scheduler.service import SchedulerService


class EmbeddedCluster:
    """All services of fedmq in this process; use as a context manager."""

    def __init__(
        self, settings: Settings, learners: int = 1, connect: Callable[[str], Bus] | None = None
    ) -> None:
        self.settings = settings
        self.broker = MemoryBroker()
        self._connect = connect or (lambda name: self.broker.connect())
        self.scheduler = SchedulerService(settings, self._connect("scheduler"))
        self.aggregator = AggregatorService(settings, self._connect("aggregator"))
        self.learners = [
            LearnerService(settings, self._connect(f"learner-{i}"), replica=i) for i in range(learners)
        ]
        self._threads: list[threading.Thread] = []

    def connect(self, name: str = "client") -> Bus:
        """A bus for a client of the cluster (the CLI, a test), on the same transport."""
        return self._connect(name)

    def __enter__(self) -> EmbeddedCluster:
        import torch

        # All services share this process's cores: torch's default of one thread per core
        # per caller makes the learners' and the aggregator's thread teams fight (measured:
        # 2x slower rounds on 2 cores). Give each learner its share unless told otherwise.
        cores = os.cpu_count() or 1
        torch.set_num_threads(self.settings.torch_threads or max(1, cores // (len(self.learners) + 1)))
        for name, service in self.services():
            service.bus.on_dead_letter = service.metrics.dead_letter
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
        for _, service in self.services():
            service.bus.stop()
        for thread in self._threads:
            thread.join(timeout=10)

    def services(self) -> list[tuple[str, SchedulerService | AggregatorService | LearnerService]]:
        return [
            ("scheduler", self.scheduler),
            ("aggregator", self.aggregator),
            *[(f"learner-{i}", learner) for i, learner in enumerate(self.learners)],
        ]


def run_job(
    spec: JobSpec,
    settings: Settings,
    *,
    learners: int = 1,
    connect: Callable[[str], Bus] | None = None,
    job_id: str | None = None,
    on_event: Callable[[JobEvent], None] | None = None,
    idle_timeout: float | None = None,
) -> dict[str, Any]:
    """Train `spec` to the end in this process; returns status, per-round history and model."""
    job_id = job_id or new_job_id(spec)
    history: list[dict[str, Any]] = []
    final: dict[str, Any] = {"status": "unknown"}
    started = time.perf_counter()
    with EmbeddedCluster(settings, learners=learners, connect=connect) as cluster:
        follower = JobFollower(cluster.connect(), job_id).start()
        try:
            submit = JobSubmit(job_id=job_id, spec=spec.model_dump(mode="json"))
            follower.bus.publish(topology.SCHEDULER, to_wire(submit))
            for event in follower.events(idle_timeout=idle_timeout):
                if on_event is not None:
                    on_event(event)
                if event.kind == "round_completed":
                    history.append(dict(event.data))
                elif event.kind in TERMINAL:
                    final = {"status": event.kind, **event.data}
        finally:
            follower.close()
        counters = {
            "model_fetches": [learner.fetches for learner in cluster.learners],
            "tasks_redelivered": sum(learner.redelivered for learner in cluster.learners),
            "reconnects": sum(getattr(s.bus, "reconnects", 0) for _, s in cluster.services()),
            "dead_letters": _merge([s.metrics.dead_letter_counts() for _, s in cluster.services()]),
        }
    return {
        **counters,
        "job_id": job_id,
        "name": spec.name,
        "wall_seconds": time.perf_counter() - started,
        **final,
        **summarize(history, None if spec.objective is None else spec.objective.model_dump()),
        "history": history,
    }


def _merge(counts: list[dict[str, float]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in counts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + int(value)
    return out


def new_job_id(spec: JobSpec) -> str:
    return f"{spec.name}-{uuid.uuid4().hex[:8]}"
