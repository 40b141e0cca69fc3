"""One job as the aggregator holds it: built from its spec, or restored from disk after a restart."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import RoundClosed, UserError
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.aggregator.store import JobStore
from fedmq.services.aggregator.strategies import Strategy, build_strategy


@dataclass
class AggJob:
    """The aggregator's view of one job: its current global model and the open round."""

    spec: JobSpec
    store: JobStore
    strategy: Strategy
    runtime: TaskRuntime
    model: nn.Module
    weights: dict[str, torch.Tensor]
    digest: str
    round: int = 0
    open_round: int | None = None
    expected: set[int] = field(default_factory=set)
    last_closed: RoundClosed | None = None  # re-sent when its trigger is redelivered
    server_data: Any = None  # the Task's server evaluation data, loaded on first use
    server_data_loaded: bool = False
    failed: UserError | None = None  # its user code raised: the job is over

    @property
    def job_id(self) -> str:
        return self.store.job_id


def views(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors (no copy): the global weights live once, in the model."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def new_job(root: Path, job_id: str, spec: JobSpec) -> AggJob:
    """A new job with its initial model built from the spec; nothing is on disk until round 0 commits."""
    return _assemble(spec, JobStore(root, job_id))


def stored_jobs(root: Path) -> list[str]:
    """The ids of the jobs under `root` with a spec and at least one committed round."""
    if not root.is_dir():
        return []
    return [
        path.name for path in sorted(root.iterdir())
        if path.is_dir() and JobStore(root, path.name).load_spec() is not None
        and JobStore(root, path.name).rounds()
    ]


def restore_job(root: Path, job_id: str) -> AggJob:
    """A stored job rebuilt from its spec, latest committed checkpoint and round records."""
    store = JobStore(root, job_id)
    spec_json = store.load_spec()
    assert spec_json is not None
    job = _assemble(JobSpec.model_validate_json(spec_json), store)
    latest = max(store.rounds())
    job.digest, job.round = store.rounds()[latest], latest
    rewind(job)
    opened = store.load_json("open")
    if opened is not None and opened["round"] == latest + 1:
        job.open_round, job.expected = opened["round"], set(opened["clients"])
    closed = store.load_json("closed")
    if closed is not None and closed["round"] == latest:
        job.last_closed = RoundClosed.model_validate(closed)
    return job


def rewind(job: AggJob) -> None:
    """Back to the weights and strategy state of the job's last committed round (after a failed close)."""
    weights, extra = job.store.load_checkpoint(job.digest)
    job.model.load_state_dict(weights)
    job.strategy.load_state(extra)
    job.weights = views(job.model)


def _assemble(spec: JobSpec, store: JobStore) -> AggJob:
    """A job's Task, model and strategy as built from its spec (initial weights); no training data."""
    runtime = TaskRuntime.for_job(spec)
    model = runtime.build_model()
    return AggJob(
        spec=spec,
        store=store,
        strategy=build_strategy(spec),
        runtime=runtime,
        model=model,
        weights=views(model),
        digest="",
    )
