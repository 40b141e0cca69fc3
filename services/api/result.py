"""What a finished job gives back in Python: its rounds, headline metrics, models and sync statistics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedmq.common.jobspec import JobSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

Fetch = Callable[[str], "Mapping[str, torch.Tensor]"]  # model digest -> weights


@dataclass(frozen=True)
class RoundRecord:
    """One round: its metrics by source ({"server": {"accuracy": ...}, "train": {...}, ...})."""

    round: int
    metrics: Mapping[str, Mapping[str, float]]
    clients: int = 0
    failed: int = 0
    num_examples: int = 0
    seconds: float = 0.0
    model_digest: str = ""
    sync: Mapping[str, float] = field(default_factory=dict)
    # Each client's training metrics, for rounds of at most 64 clients (else empty)
    client_metrics: Mapping[int, Mapping[str, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> RoundRecord:
        return cls(
            round=int(raw["round"]), metrics=raw.get("metrics", {}), clients=int(raw.get("clients", 0)),
            failed=int(raw.get("failed", 0)), num_examples=int(raw.get("num_examples", 0)),
            seconds=float(raw.get("seconds", 0.0)), model_digest=str(raw.get("model_digest", "")),
            sync=raw.get("sync", {}),
            client_metrics={int(c): m for c, m in raw.get("client_metrics", {}).items()},
        )

    def get(self, metric: str) -> float | None:
        """A metric by "source.name", or None if this round has none."""
        source, _, name = metric.partition(".")
        return self.metrics.get(source, {}).get(name)


@dataclass(frozen=True)
class SyncStats:
    """What synchronising cost over the whole job (seed 002's get_sync_stats)."""

    rounds: int
    bytes_sent: int  # clients' updates, learners -> aggregator
    bytes_received: int  # global models fetched by learners
    train_seconds: float  # time in local training, summed over clients
    transfer_seconds: float  # time learners spent fetching global models
    aggregation_seconds: float  # time the aggregator spent closing rounds
    round_seconds: float  # wall time of the rounds, summed


@dataclass
class Result:
    """A job's outcome; `model()`, `final_model()`, `best_model()` rebuild models with the job's Task."""

    job_id: str
    spec: JobSpec
    status: str
    reason: str
    history: list[RoundRecord]
    best: Mapping[str, Any] | None
    model_path: str | None
    _fetch: Fetch | None = field(default=None, repr=False)
    # (client, the round after its last) -> its kept state's entries, opened
    _client_state: Callable[[int, int], Mapping[str, torch.Tensor]] | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "completed"

    @property
    def final(self) -> RoundRecord | None:
        return self.history[-1] if self.history and self.history[-1].round > 0 else None

    def metric(self, name: str) -> list[tuple[int, float]]:
        """(round, value) of a metric ("server.accuracy", "train.loss", ...) over the job."""
        return [(r.round, v) for r in self.history if (v := r.get(name)) is not None]

    @property
    def sync_stats(self) -> SyncStats:
        def total(key: str) -> float:
            return sum(float(r.sync.get(key, 0.0)) for r in self.history)

        return SyncStats(
            rounds=sum(1 for r in self.history if r.round > 0),
            bytes_sent=int(total("bytes_up")), bytes_received=int(total("bytes_down")),
            train_seconds=total("train_seconds"), transfer_seconds=total("fetch_seconds"),
            aggregation_seconds=total("aggregate_seconds"),
            round_seconds=sum(r.seconds for r in self.history if r.round > 0),
        )

    def weights(self, which: str | int = "final") -> Mapping[str, torch.Tensor]:
        """The global weights of round `which` (an int), or of the "final" or "best" round."""
        digest = self._digest(which)
        if self._fetch is None:
            raise RuntimeError("this result cannot fetch models (it was built without a connection)")
        return self._fetch(digest)

    def client_state(self, client: int) -> dict[str, Any]:
        """What `ctx.state` held after `client` last trained (a Task with `keeps_state`,
        train.keep_optimizer_state, personalize); {} if it kept none. Over a broker it comes from the
        aggregator, sealed if the learners seal it: this process then needs their FEDMQ_STATE_KEY."""
        from fedmq.common.task.state import state_of

        if self._client_state is None:
            raise RuntimeError("this result cannot read client state (it was built without a connection)")
        last = self.history[-1].round if self.history else 0
        return state_of(self._client_state(client, last + 1))

    def model(self, which: str | int = "final") -> nn.Module:
        """The job's model with the weights of `which` (see `weights`), in eval mode."""
        from fedmq.common.task.runtime import TaskRuntime

        model = TaskRuntime.for_job(self.spec).build_model()
        model.load_state_dict(dict(self.weights(which)))
        return model.eval()

    def final_model(self) -> nn.Module:
        return self.model("final")

    def best_model(self) -> nn.Module:
        """The model of the round the objective picked (the final one when the job has no objective).

        LookupError when the job's objective names a metric no round reported (a typo).
        """
        return self.model("best")

    def _digest(self, which: str | int) -> str:
        if which == "best" and self.best is not None:
            return str(self.best["model_digest"])
        if which == "best" and self.spec.objective is not None and self.ok:
            names = sorted({f"{s}.{n}" for r in self.history for s, m in r.metrics.items() for n in m})
            raise LookupError(
                f"job {self.job_id}: its objective {self.spec.objective.metric} was never reported, so "
                f"no round is best (its metrics: {', '.join(names) or 'none'}); fix objective.metric"
            )
        if which in ("final", "best"):
            if not self.history:
                raise LookupError(f"job {self.job_id} has no rounds")
            return self.history[-1].model_digest
        for record in self.history:
            if record.round == which:
                return record.model_digest
        raise LookupError(f"job {self.job_id} has no round {which!r}")
