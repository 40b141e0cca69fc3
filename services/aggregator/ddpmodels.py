"""A DDP job's models at the aggregator: rank 0's checkpoints and final model, kept and served like
a round's (serving.ModelServer answers ModelGet for them).

    DdpModel (from the group's rank 0) ─▶ store:
        STATE/aggregator/<job>/spec.json                 the job's spec, once
        STATE/aggregator/<job>/checkpoints/<digest>...   the weights (a content-addressed checkpoint)
        STATE/aggregator/<job>/ddp_checkpoints.json      {step or "final": key}, pruned to the
                                                         newest max(FEDMQ_KEEP_CHECKPOINTS, 2)
        STATE/aggregator/<job>/model.safetensors         the final model
    ─▶ DdpStored (the caller publishes it to the scheduler)

Idempotent: a checkpoint is named by its digest, so a redelivery only says it again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import structlog
import torch

from fedmq.common.checkpoint import save_model
from fedmq.common.errors import ValidationError
from fedmq.common.jobspec import parse_job
from fedmq.common.messages import DdpModel, DdpStored
from fedmq.common.settings import Settings
from fedmq.common.statefiles import JOB_ID
from fedmq.services.aggregator.jobs import AggJob
from fedmq.services.aggregator.limits import check_model
from fedmq.services.aggregator.store import JobStore, weights_digest

log = structlog.get_logger("fedmq.aggregator")

DDP_CHECKPOINTS = "ddp_checkpoints"  # a DDP job's stored checkpoints: {step or "final": key}


class DdpModels:
    """DDP jobs' models under `root`, beside the federated `jobs` (whose ids they may not take)."""

    def __init__(self, root: Path, settings: Settings, jobs: Mapping[str, AggJob]) -> None:
        self.root = root
        self.settings = settings
        self.jobs = jobs

    def store(self, msg: DdpModel) -> DdpStored:
        """A DDP job's checkpoint or final model from its rank 0, kept; what the scheduler is told."""
        spec = parse_job(msg.spec)
        if spec.ddp is None:
            raise ValidationError("invalid_spec", "a DDP model for a job that is not a DDP job")
        federated = msg.job_id in self.jobs or JobStore(self.root, msg.job_id).rounds()
        if not JOB_ID.fullmatch(msg.job_id) or federated:
            raise ValidationError("unknown_job", f"{msg.job_id[:80]!r} is no DDP job's id")
        weights = {name: value for name, value in msg.weights.items() if isinstance(value, torch.Tensor)}
        if len(weights) != len(msg.weights) or not weights:
            raise ValidationError("wrong_tensors", "a DDP model holds tensors only")
        check_model(weights, self.settings.max_model_bytes)
        store = JobStore(self.root, msg.job_id, self.settings.fsync)
        if store.load_spec() is None:
            store.save_spec(json.dumps(msg.spec, sort_keys=True))
        key = store.write_checkpoint(msg.step, weights, {})
        digest = weights_digest(key)
        model_path = ""
        if msg.kind == "final":
            path = store.root / "model.safetensors"
            save_model(path, weights, json.dumps(msg.spec, sort_keys=True), job_id=msg.job_id, round=1)
            model_path = str(path)
        self._prune(store, msg, key)
        log.info("ddp_model_stored", kind=msg.kind, step=msg.step, digest=digest[:12])
        return DdpStored(job_id=msg.job_id, attempt=msg.attempt, kind=msg.kind, step=msg.step,
                         digest=digest, model_path=model_path)

    def _prune(self, store: JobStore, msg: DdpModel, key: str) -> None:
        """With FEDMQ_KEEP_CHECKPOINTS=N, a DDP job keeps its newest max(N, 2) checkpoints by step
        (a restart resumes from the newest the scheduler has heard of) and its final model."""
        kept = store.load_json(DDP_CHECKPOINTS) or {}
        kept[msg.kind if msg.kind == "final" else str(msg.step)] = key
        steps = sorted((s for s in kept if s != "final"), key=int)
        keep = self.settings.keep_checkpoints
        if keep:
            final = {"final": kept["final"]} if "final" in kept else {}
            kept = {s: kept[s] for s in steps[-max(keep, 2):]} | final
        store.save_json(DDP_CHECKPOINTS, kept)
        if keep and (gone := store.prune_checkpoints(set(kept.values()))):
            log.info("checkpoints_pruned", count=len(gone), kept=len(kept))
