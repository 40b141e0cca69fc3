"""What `fedmq submit` learns from the scheduler before it publishes a job: learners to run it.

A job is never refused for want of learners (they may be on their way); the user is told
what will happen to it meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fedmq.common.jobspec import JobSpec


def learners_warning(spec: JobSpec, learners: Iterable[Mapping[str, Any]]) -> str | None:
    """Why no learner alive can train `spec`'s clients, from `fedmq learners`' rows; None if some can."""
    alive = [row for row in learners if row.get("alive")]
    if spec.clients.sites is None:
        takers = [row for row in alive if not row.get("sites")]  # FEDMQ_SITES: its sites' tasks only
        if takers:
            return None
        who = "no learner is alive" if not alive else "every learner alive hosts sites (FEDMQ_SITES)"
        return f"{who}: {_waits(spec)}; start one with `fedmq learner`"
    hosted = {site for row in alive for site in row.get("sites") or []}
    missing = [site for site in spec.clients.sites if site not in hosted]
    if not missing:
        return None
    return (
        f"no learner alive hosts site(s) {', '.join(missing)}: their clients are dropped from each "
        f"round, which fails with fewer than {spec.clients.quorum} clients left; start a learner with "
        "FEDMQ_SITES naming them (see `fedmq learners`)"
    )


def _waits(spec: JobSpec) -> str:
    """What a job of logical clients does with no learner: its tasks wait, each round attempt times out."""
    seconds = spec.round_timeout_s * (1 + spec.max_round_retries)
    return (
        "the job's tasks wait in the queue for one, and with none it fails after "
        f"{seconds:g} s (round_timeout_s {spec.round_timeout_s:g} x {1 + spec.max_round_retries} attempts)"
    )
