"""One round's bookkeeping as a pure object: who reported, who failed, is it done.

    open ──(all sampled reported)──────────────────▶ CLOSE
      │ ──(deadline, reported ≥ quorum)─────────────▶ CLOSE
      │ ──(deadline or all settled, below quorum)───▶ RETRY (missing clients again)
      │                                   attempts left = 0 ▶ FAIL
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fedmq.common.messages import ClientFailure


class Decision(enum.Enum):
    WAIT = "wait"
    CLOSE = "close"
    RETRY = "retry"
    FAIL = "fail"


@dataclass
class RoundState:
    round: int
    clients: list[int]
    quorum: int
    deadline: float
    retries_left: int = 0
    started: float = 0.0
    reported: dict[int, int] = field(default_factory=dict)  # client → examples
    failed: dict[int, str] = field(default_factory=dict)  # client → reason
    phases: dict[int, str] = field(default_factory=dict)  # client → where it failed (for the strategy)
    final: set[int] = field(default_factory=set)  # clients that failed in a way a retry repeats
    # client → (the learner of its accepted update, that update's state tag)
    learners: dict[int, tuple[str, str]] = field(default_factory=dict)
    closing: bool = False

    def record_update(self, client: int, num_examples: int, learner: str = "", state_tag: str = "") -> bool:
        """Count a client's accepted update; False for a duplicate or a stranger."""
        if self.closing or client not in self.clients or client in self.reported:
            return False
        self._reported(client, num_examples)
        if learner and state_tag:
            self.learners[client] = (learner, state_tag)
        return True

    def fold_in(self, clients: list[int]) -> None:
        """The round closed folding `clients`: each is reported (examples unknown here, 0), whatever
        was heard of it before. Nothing else the closed round keeps changes."""
        for client in clients:
            if client in self.clients and client not in self.reported:
                self._reported(client, 0)

    def _reported(self, client: int, num_examples: int) -> None:
        """`client` counted as reported: any failure heard of it before is forgotten."""
        self.reported[client] = num_examples
        self.failed.pop(client, None)
        self.phases.pop(client, None)

    def record_failure(self, client: int, reason: str, phase: str = "error") -> bool:
        if self.closing or client not in self.clients or client in self.reported:
            return False
        self.failed[client] = reason
        self.phases[client] = phase
        return True

    def record_client_failure(self, failure: ClientFailure, training: bool = True) -> bool:
        """A learner's ClientFailure: its code and reason, and for training the phase it failed in
        (its user code's, else its code; the scheduler's own placement failure is an error)."""
        reason = f"{failure.code}: {failure.reason}"
        if failure.code in FINAL_CODES and failure.client in self.missing:
            self.final.add(failure.client)
        if not training:
            return self.record_failure(failure.client, reason)
        phase = failure.error.phase if failure.error is not None else failure.code
        return self.record_failure(failure.client, reason, "error" if phase == "placement" else phase)

    def unreported(self) -> list[tuple[int, str, str]]:
        """(client, reason, phase) of each sampled client without an update: failed, or silent."""
        return [
            (c, self.failed[c], self.phases.get(c, "error")) if c in self.failed
            else (c, "no update by the round's deadline", "timeout")
            for c in self.missing
        ]

    @property
    def missing(self) -> list[int]:
        return [c for c in self.clients if c not in self.reported]

    @property
    def retryable(self) -> list[int]:
        """The missing clients another attempt could bring: not those whose failure it repeats."""
        return [c for c in self.missing if c not in self.final]

    def decide(self, now: float) -> Decision:
        if self.closing:
            return Decision.WAIT
        if len(self.reported) == len(self.clients):
            return Decision.CLOSE
        settled = len(self.reported) + len(self.failed) == len(self.clients)
        if now < self.deadline and not settled:
            return Decision.WAIT
        if len(self.reported) >= self.quorum:
            return Decision.CLOSE
        return Decision.RETRY if self.retries_left > 0 and self.retryable else Decision.FAIL

    def retry(self, deadline: float) -> list[int]:
        """Start another attempt for the clients still missing, but those whose failure a retry
        repeats (they stay failed); returns them."""
        self.retries_left -= 1
        self.deadline = deadline
        again = self.retryable
        self.failed = {c: r for c, r in self.failed.items() if c in self.final}
        self.phases = {c: p for c, p in self.phases.items() if c in self.final}
        return again


# A client's failure that every attempt repeats: its data cannot train (none at all). Not retried.
FINAL_CODES = frozenset({"no_data"})


def fails_job(failure: ClientFailure, on_error: str) -> bool:
    """Whether a client's failure fails its job: its user code raised, and clients.on_error is fail_job."""
    return failure.error is not None and on_error == "fail_job"
