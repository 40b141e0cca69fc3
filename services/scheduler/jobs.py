"""The scheduler's record of one job: its spec, status, round, history and open round."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fedmq.common.bus.base import Timer
from fedmq.common.jobspec import JobSpec
from fedmq.common.strategy.contract import CLIENT_STATE, LEARNER_STATE
from fedmq.services.scheduler.rounds import RoundState

RUNNING, COMPLETED, FAILED, CANCELLED = "running", "completed", "failed", "cancelled"


@dataclass
class SchedJob:
    job_id: str
    spec: JobSpec
    raw_spec: dict[str, Any]
    status: str = RUNNING
    round: int = 0
    model_digest: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # the strategy's config for the next round's tasks
    state: RoundState | None = None
    timer: Timer | None = None
    nudge: Timer | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    # The open round's traffic and time, summed from its accepted updates.
    sync: dict[str, float] = field(default_factory=dict)
    # Federated evaluation of the round just closed: its bookkeeping, the reports so far
    # (client -> examples, metrics, reduction rules) and the round's record awaiting them.
    evaluation: RoundState | None = None
    eval_reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    pending: dict[str, Any] | None = None
    best: dict[str, Any] | None = None  # the objective's best round: round, value, model_digest

    error: dict[str, Any] | None = None  # where user code raised, when that ended the job
    accepted_at: float = 0.0  # wall clock: the start deadline counts from here, across restarts
    finished_at: float = 0.0  # wall clock: when it completed, failed or was cancelled
    group: dict[str, Any] | None = None  # a DDP job's group: members, attempt, exits (scheduler/ddp.py)
    # Clients whose learner keeps their state (learner/statecache.py): client → (the round whose
    # close last folded it, the learner of that update, its state tag). None: not known for every
    # round (a job from before they were kept, or one whose state is not the learners' alone).
    holders: dict[int, tuple[int, str, str]] | None = None
    # The global model of model_digest, packed, when the aggregator sent it with its RoundClosed (a
    # small one): it goes to the learners with the round's tasks. Not saved: after a restart they
    # fetch it.
    model: bytes = field(default=b"", repr=False)

    @property
    def wall_seconds(self) -> float | None:
        """From acceptance to the end (or to now while it runs); None if not known."""
        if not self.accepted_at:
            return None
        return (self.finished_at or time.time()) - self.accepted_at

    @property
    def active(self) -> RoundState | None:
        """The bookkeeping whose deadline runs now: the evaluation, else the training round."""
        return self.evaluation if self.evaluation is not None else self.state


def tracks_holders(job: SchedJob) -> bool:
    """Whether the job's clients train on state only learners make and the scheduler knows, for
    each, whose copy is the folded one (so a learner's copy may serve)."""
    return job.holders is not None and job.config.get(CLIENT_STATE) == LEARNER_STATE


def note_holders(job: SchedJob, folded: list[int], state: RoundState) -> None:
    """The round `state` closed, folding `folded`: their state is now that round's, their learner's.
    A round whose state was not the learners' alone ends the record for good: from then on every
    state is fetched (a gap would make `state_from` lie)."""
    if job.holders is None:
        return
    if job.config.get(CLIENT_STATE) != LEARNER_STATE:
        job.holders = None
        return
    for client in folded:
        learner, tag = state.learners.get(client, ("", ""))
        job.holders[client] = (state.round, learner, tag)
