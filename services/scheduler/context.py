"""What the scheduler's loops share, and the three things each of them does to a job.

    SchedulerService ─ builds ─▶ SchedContext ◀─ held by ─ RoundLoop, EvaluationLoop, DdpLoop
                                 settings, bus, metrics, jobs, rows, retry, registry, grace_until
                                 event (to its watchers) · save (its row) · finish (its end)

The service builds the stores and hands them to one context; the loops read and change the jobs
through it, never through one another's attributes.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import structlog

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.errors import StateUnwritable
from fedmq.common.messages import DdpStop, EventKind, JobEvent, to_wire
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.common.stateretry import StateRetry
from fedmq.services.scheduler.jobs import CANCELLED, COMPLETED, FAILED, SchedJob
from fedmq.services.scheduler.registry import Registry
from fedmq.services.scheduler.store import JobRows

log = structlog.get_logger("fedmq.scheduler")


@dataclass(eq=False)
class SchedContext:
    """The scheduler's settings, bus, metrics, jobs and their rows, and its registry of learners."""

    settings: Settings
    bus: Bus
    metrics: Metrics
    jobs: dict[str, SchedJob]
    rows: JobRows
    retry: StateRetry
    registry: Registry
    grace_until: float  # monotonic: until then, no site counts as unserved (see hearing_learners)

    def hearing_learners(self) -> bool:
        """Just started: an alive learner beats every FEDMQ_LIVENESS_S, so until then (and a half)
        its heartbeat may not have come, and no site counts as unserved: its tasks wait in its queue,
        and the round's deadline drops a site that is really gone."""
        return time.monotonic() < self.grace_until

    def save(self, job: SchedJob) -> None:
        """Persist what a timer changed (no message will come again): retried until the disk takes it."""
        try:
            self.rows.save(job)
        except StateUnwritable as exc:
            self.retry.later(exc, functools.partial(self.save, job))

    def finish(
        self, job: SchedJob, status: str, reason: str, error: dict[str, Any] | None = None, **data: Any
    ) -> None:
        """End the job; `error`: where its user code raised (then in the event's data too)."""
        job.status, job.reason, job.error = status, reason, error
        job.finished_at = time.time()
        job.model = b""  # no more tasks to send it with
        if job.group and job.group.get("members"):  # cancelled, or failed otherwise: its ranks end too
            for name in job.group["members"]:
                stop = DdpStop(job_id=job.job_id, attempt=job.group["attempt"])
                self.bus.publish(topology.learner_queue(name), to_wire(stop))
            job.group["members"] = {}
        if error is not None:
            data["error"] = error
        if job.wall_seconds is not None:
            data["wall_seconds"] = round(job.wall_seconds, 3)
        cancel_timers(job)
        kind: EventKind = {COMPLETED: "completed", FAILED: "failed", CANCELLED: "cancelled"}[status]  # type: ignore[assignment]
        self.event(job.job_id, kind, round=job.round, data={"reason": reason, **data})
        log.info("job_finished", status=status, reason=reason)

    def event(self, job_id: str, kind: EventKind, round: int | None = None,
              rounds: int | None = None, data: dict[str, Any] | None = None) -> None:
        event = JobEvent(job_id=job_id, kind=kind, round=round, rounds=rounds, data=data or {})
        self.bus.publish_event(topology.job_topic(job_id), to_wire(event))


def cancel_timers(job: SchedJob) -> None:
    """Stop the job's deadline and nudge timers (whichever round or evaluation armed them)."""
    for timer in (job.timer, job.nudge):
        if timer is not None:
            timer.cancel()
