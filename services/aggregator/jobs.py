"""One job as the aggregator holds it: built from its spec, or restored from disk after a restart."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedmq.common.allowlist import AllowList
from fedmq.common.coderefs import check_code
from fedmq.common.errors import ConfigError
from fedmq.common.heap import LARGE_MODEL_BYTES, large_buffers_unmapped
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import RoundClosed, UserError
from fedmq.common.strategy.clients import ClientStore
from fedmq.common.strategy.contract import Strategy
from fedmq.common.strategy.loading import check_strategy, make_strategy
from fedmq.common.task.contract import Personal
from fedmq.common.task.layers import own_layers
from fedmq.common.task.runtime import TaskRuntime
from fedmq.common.usercode import user_code
from fedmq.services.aggregator.limits import DiskQuota, model_bytes
from fedmq.services.aggregator.store import JobStore, weights_digest

CLIENTS = "clients"  # the job folder's subfolder of the strategy's per-client state
RESIDUALS = "residuals"  # and of topk's residuals


@dataclass
class AggJob:
    """The aggregator's view of one job: its current global model and the open round."""

    spec: JobSpec
    store: JobStore
    strategy: Strategy
    runtime: TaskRuntime
    model: nn.Module
    weights: dict[str, torch.Tensor]
    digest: str  # the global weights' digest: what learners ask for
    checkpoint: str = ""  # the committed round's checkpoint key (weights and strategy state)
    round: int = 0
    open_round: int | None = None
    expected: set[int] = field(default_factory=set)
    # RoundOpen's close_when_complete and keep: the round closes here once `arrived` holds every
    # expected client (the updates stored through the group commit, or stored when it opened).
    close_when_complete: bool = False
    keep: list[str] = field(default_factory=list)
    arrived: set[int] = field(default_factory=set)
    last_closed: RoundClosed | None = None  # re-sent when its trigger is redelivered
    server_data: Any = None  # the Task's server evaluation data, loaded on first use
    server_data_loaded: bool = False
    failed: UserError | None = None  # its user code raised: the job is over
    # Each client's example count as first accepted: no later update of it may claim more.
    examples: dict[int, int] = field(default_factory=dict)
    disk: DiskQuota | None = None  # its state's disk against FEDMQ_JOB_DISK_BYTES (set by the service)
    stopped: str | None = None  # it passed a limit (limits.OverLimit): the job is over, for this reason
    unpruned: bool = True  # checkpoints never committed may lie on disk (service._prune looks once)
    # Where per-client state lives: None, on disk beside the checkpoints (the aggregator); the
    # in-process engine gives stores of its own that it writes to disk with its checkpoints.
    client_store: ClientStore | None = None
    residual_store: ClientStore | None = None

    def complete(self) -> bool:
        """Whether the open round closes here now: asked to, and every client's update stored."""
        return (self.open_round is not None and self.close_when_complete and bool(self.expected)
                and self.expected <= self.arrived and self.failed is None and self.stopped is None)

    @property
    def job_id(self) -> str:
        return self.store.job_id

    @property
    def clients(self) -> ClientStore:
        """The strategy's per-client state, on disk beside the job's checkpoints."""
        return self.client_store or ClientStore(self.store.root / CLIENTS)

    @property
    def residuals(self) -> ClientStore:
        """Each client's topk error-feedback residual (compression), kept apart from the strategy's state."""
        return self.residual_store or ClientStore(self.store.root / RESIDUALS)


def views(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors (no copy): the global weights live once, in the model."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def new_job(root: Path, job_id: str, spec: JobSpec, allowed: AllowList, sync: bool = True) -> AggJob:
    """A new job with its initial model built from the spec; nothing is on disk until round 0 commits.

    Its Task and strategy come only from modules `allowed` lets in (CodeNotAllowed, before importing),
    and its strategy checks the job first (a job published without fedmq's CLI or API is refused here).
    """
    check_code(spec, allowed)  # every name first, before check_strategy imports anything
    check_strategy(spec, allowed)
    return _assemble(spec, JobStore(root, job_id, sync), allowed)


def stored_jobs(root: Path) -> list[str]:
    """The ids of the jobs under `root` with a spec and at least one committed round."""
    if not root.is_dir():
        return []
    return [
        path.name for path in sorted(root.iterdir())
        if path.is_dir() and JobStore(root, path.name).load_spec() is not None
        and JobStore(root, path.name).rounds()
    ]


def restore_job(
    root: Path, job_id: str, allowed: AllowList, sync: bool = True, at: int | None = None
) -> AggJob:
    """A stored job rebuilt from its spec, latest committed checkpoint (or round `at`'s) and round records."""
    store = JobStore(root, job_id, sync)
    spec_json = store.load_spec()
    assert spec_json is not None
    job = _assemble(JobSpec.model_validate_json(spec_json), store, allowed)
    latest = max(store.rounds()) if at is None else at
    job.checkpoint, job.round = store.rounds()[latest], latest
    job.digest = weights_digest(job.checkpoint)
    rewind(job)
    opened = store.load_json("open")
    if opened is not None and opened["round"] == latest + 1:
        job.open_round, job.expected = opened["round"], set(opened["clients"])
        job.close_when_complete, job.keep = bool(opened.get("close")), list(opened.get("keep", []))
        job.arrived = set(store.stored_clients(job.open_round))
    job.examples = {int(c): int(n) for c, n in (store.load_json("examples") or {}).items()}
    closed = store.load_json("closed")
    if closed is not None and closed["round"] == latest:
        job.last_closed = RoundClosed.model_validate(closed)
    return job


def rewind(job: AggJob) -> None:
    """Back to the weights and strategy state of the job's last committed round (after a failed close)."""
    weights, extra = job.store.load_checkpoint(job.checkpoint)
    job.model.load_state_dict(weights)
    with user_code("strategy.load_state", round=job.round):
        job.strategy.load_state(extra)
    job.weights = views(job.model)


def _assemble(spec: JobSpec, store: JobStore, allowed: AllowList) -> AggJob:
    """A job's Task, model and strategy as built from its spec (initial weights); no training data."""
    check_code(spec, allowed)  # every name first, before the Task's module runs
    runtime = TaskRuntime.for_job(spec, allowed)
    model = runtime.build_model()
    if (personal := Personal.from_spec(spec.personalize)) is not None and personal.method == "fedper":
        try:  # `fedmq submit` checked it; a job from the API or an older CLI is checked here
            own_layers(model, personal)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if model_bytes(views(model)) >= LARGE_MODEL_BYTES:
        large_buffers_unmapped()  # folds of its updates free large buffers: give them back
    return AggJob(
        spec=spec,
        store=store,
        strategy=make_strategy(spec.strategy, allowed),
        runtime=runtime,
        model=model,
        weights=views(model),
        digest="",
    )
