"""How a job ends at the aggregator before its last round, and what it answers afterwards.

    user code raised (build, data, evaluate)  ─▶ job.failed   ─▶ JobFailed(reason, error) ─▶ scheduler
    a limit of this deployment passed         ─▶ job.stopped  ─▶ JobFailed(reason)
    its code not allowed (FEDMQ_ALLOWED_CODE) ─▶ not kept     ─▶ JobFailed(reason)
    then: a JobCreate or RoundClose for it    ─▶ JobFailed again; any other message is ignored
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import structlog

from fedmq.common.allowlist import CodeNotAllowed
from fedmq.common.messages import JobCreate, JobFailed, Message, RoundClose
from fedmq.common.metrics import Metrics
from fedmq.common.usercode import UserCodeError
from fedmq.services.aggregator.jobs import AggJob
from fedmq.services.aggregator.limits import OverLimit

log = structlog.get_logger("fedmq.aggregator")


class JobFailures:
    """Ends `jobs` that fail, telling the scheduler through `publish`."""

    def __init__(
        self, jobs: Mapping[str, AggJob], metrics: Metrics, publish: Callable[[Message], None]
    ) -> None:
        self.jobs = jobs
        self.metrics = metrics
        self.publish = publish

    def user_code(self, job_id: str, exc: UserCodeError, server_round: int) -> None:
        """The job's user code raised: the job is over; the scheduler hears where and why."""
        error = exc.info("aggregator", round=server_round)
        log.warning("user_code_failed", job=job_id, phase=error.phase, error_type=error.type,
                    error=error.message[:300])
        job = self.jobs.get(job_id)
        if job is not None:
            job.failed = error
        self.publish(JobFailed(job_id=job_id, reason=error.line(), error=error))

    def over_limit(self, job_id: str, exc: OverLimit) -> None:
        """The job passed a limit of this deployment: it is over, and the scheduler hears why."""
        reason = f"aggregator: {exc}"
        log.warning("job_over_limit", job=job_id, limit=exc.limit, reason=reason)
        self.metrics.refused(exc.limit)
        job = self.jobs.get(job_id)
        if job is not None:
            job.stopped = reason
        self.publish(JobFailed(job_id=job_id, reason=reason))

    def code_refused(self, exc: CodeNotAllowed) -> None:
        """The job names code the allow-list refuses: logged and counted (the caller says JobFailed)."""
        log.warning("job_code_refused", what=exc.what, module=exc.module)
        self.metrics.refused_code(exc.what)

    def ended(self, msg: Message) -> bool:
        """Whether `msg` is for a job that has failed or stopped: then it is ignored, and a JobCreate
        or RoundClose for it is answered with its JobFailed again."""
        job = self.jobs.get(msg.job_id)
        if job is None or (job.failed is None and job.stopped is None):
            return False
        log.info("ignored_failed_job", type=msg.type)  # type: ignore[attr-defined]
        if isinstance(msg, JobCreate | RoundClose):
            reason = job.failed.line() if job.failed is not None else str(job.stopped)
            self.publish(JobFailed(job_id=job.job_id, reason=reason, error=job.failed))
        return True
