"""Pruning a job's checkpoints after each round, and keeping its disk to its quota (limits.DiskQuota).

    a round committed ─▶ prune:
        checkpoints older than the last FEDMQ_KEEP_CHECKPOINTS rounds go, except the current one
        and those the scheduler asks to keep (RoundClose.keep: the best round's); with a close
        that failed or a start (`job.unpruned`), every checkpoint never committed goes too
        the job's folder walked again every MEASURE_EVERY rounds, and every round when the job
        keeps per-client state (a strategy's, topk residuals), which the quota's count does not see
    before an update, a checkpoint or the initial model is written ─▶ disk(job).need(size, what)
"""

from __future__ import annotations

import structlog

from fedmq.common.settings import Settings
from fedmq.services.aggregator.jobs import AggJob
from fedmq.services.aggregator.limits import DiskQuota, retained
from fedmq.services.aggregator.rounds import keeps_learner_state

log = structlog.get_logger("fedmq.aggregator")

MEASURE_EVERY = 16  # rounds between walks of a job's folder for its disk quota (limits.DiskQuota)


class Pruner:
    """Old checkpoints out (FEDMQ_KEEP_CHECKPOINTS), and each job's disk against FEDMQ_JOB_DISK_BYTES."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def prune(self, job: AggJob, keep: list[str]) -> None:
        """Old checkpoints go (FEDMQ_KEEP_CHECKPOINTS), and any never committed (a close that failed,
        a crash before its commit: looked for once after a start or a failed close). The job's disk
        is measured again every MEASURE_EVERY rounds, and every round when the job keeps per-client
        state (a strategy's, topk residuals), which the quota's count of updates does not see."""
        if self.settings.keep_checkpoints or job.unpruned:
            keep_rounds = self.settings.keep_checkpoints
            kept = retained(job.store.rounds(), job.round, keep_rounds, [job.digest, *keep])
            if gone := job.store.prune_checkpoints(kept):
                log.info("checkpoints_pruned", count=len(gone), kept=len(kept))
            job.unpruned = False
        if job.round % MEASURE_EVERY == 0 or job.strategy.sends_client_state or keeps_learner_state(job):
            self.disk(job).measure()

    def disk(self, job: AggJob) -> DiskQuota:
        """The job's disk quota, measured on first use."""
        if job.disk is None:
            job.disk = DiskQuota(job.store.root, self.settings.job_disk_bytes)
        return job.disk

    def measure(self, job: AggJob) -> None:
        """Walk the job's folder again at the next check (files were deleted)."""
        self.disk(job).measure()
