"""One job as the aggregator holds it: built from its spec, or restored from disk after a restart."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedmq.common.jobspec import JobSpec, canonical_json
from fedmq.common.messages import RoundClosed
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

    @property
    def job_id(self) -> str:
        return self.store.job_id


def views(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors (no copy): the global weights live once, in the model."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def create_job(root: Path, job_id: str, spec: JobSpec) -> AggJob:
    """A new job: its initial model built from the spec, the spec and round 0 stored on disk."""
    store = JobStore(root, job_id)
    job = _assemble(spec, store)
    store.save_spec(canonical_json(spec))
    job.digest = store.save_checkpoint(0, job.weights, {})
    return job


def resume_jobs(root: Path) -> Iterator[AggJob]:
    """Every job found under `root`, rebuilt from its spec, latest checkpoint and round records."""
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        store = JobStore(root, path.name)
        spec_json = store.load_spec() if path.is_dir() else None
        if spec_json is None or not store.rounds():
            continue
        yield _restore(JobSpec.model_validate_json(spec_json), store)


def _restore(spec: JobSpec, store: JobStore) -> AggJob:
    job = _assemble(spec, store)
    latest = max(store.rounds())
    weights, extra = store.load_checkpoint(store.rounds()[latest])
    job.model.load_state_dict(weights)
    job.strategy.load_state(extra)
    job.weights, job.digest, job.round = views(job.model), store.rounds()[latest], latest
    opened = store.load_json("open")
    if opened is not None and opened["round"] == latest + 1:
        job.open_round, job.expected = opened["round"], set(opened["clients"])
    closed = store.load_json("closed")
    if closed is not None and closed["round"] == latest:
        job.last_closed = RoundClosed.model_validate(closed)
    return job


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
