"""What one deployment lets a submission ask for: clients, rounds and jobs running at once.

A pure check the scheduler runs on every JobSubmit after the spec parsed (which bounded its
size and depth): the first limit passed is refused with a message naming the setting to raise.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedmq.common.jobspec import JobSpec
from fedmq.common.settings import Settings


@dataclass(frozen=True)
class Refusal:
    limit: str  # a JOB_LIMITS label (common/metrics)
    message: str


def check_submission(spec: JobSpec, settings: Settings, running: int) -> Refusal | None:
    """None if the job fits this deployment's limits; else the first limit it passes."""
    if spec.clients.total > settings.max_clients:
        return Refusal("max_clients", f"clients.total is {spec.clients.total}, more than this deployment "
                       f"allows ({settings.max_clients}, FEDMQ_MAX_CLIENTS)")
    if spec.rounds > settings.max_rounds:
        return Refusal("max_rounds", f"rounds is {spec.rounds}, more than this deployment allows "
                       f"({settings.max_rounds}, FEDMQ_MAX_ROUNDS)")
    if running >= settings.max_jobs:
        return Refusal("max_jobs", f"{running} jobs are running, as many as this deployment allows "
                       f"(FEDMQ_MAX_JOBS={settings.max_jobs}): submit again when one has finished")
    return None
