"""For a DDP job's entry: its options, its checkpoints and its final model (seed 003).

An entry is a plain torch.distributed program: it reads MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK, LOCAL_RANK and NODE_RANK from the environment (init_method="env://"), so the same file
runs under `torchrun`. These helpers add what fedmq does with it:

    opts = fedmq.ddp.options()                 # the spec's ddp.options (a dict)
    resumed = fedmq.ddp.load_checkpoint()      # (tensors, step) after a restart, else None
    fedmq.ddp.save_checkpoint(state, step)     # rank 0, now and then: the restart point
    fedmq.ddp.report(epoch, {"loss": 0.31}, total=epochs)  # rank 0: metrics per step or epoch
    fedmq.ddp.save_model(model.state_dict())   # rank 0, at the end: the job's model

Under fedmq, rank 0's learner sends each checkpoint and the model to the aggregator, which
keeps and serves them like any job's model (`fedmq model`); after a failure the group starts
again from the last checkpoint. Rank 0's reports show in `fedmq watch` (and `fedmq run`), in
`fedmq status` and as Prometheus's fedmq_round_metric{source="train"}; every rank's output
lines stream to `watch` as they come. Under torchrun they are files in FEDMQ_DDP_DIR (default
`ddp-out/`; reports: `metrics.jsonl`). Tensors only (safetensors): put a step counter or a
learning rate in a tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CHECKPOINT = "checkpoint.safetensors"
MODEL = "model.safetensors"
REPORTS = "metrics.jsonl"
STEP_KEY = "fedmq.step"


def options() -> dict[str, Any]:
    """The spec's `ddp.options` (FEDMQ_DDP_OPTIONS, JSON); {} under torchrun without it."""
    value = json.loads(os.environ.get("FEDMQ_DDP_OPTIONS", "{}"))
    return value if isinstance(value, dict) else {}


def out_dir() -> Path:
    """Where this rank's files go (FEDMQ_DDP_DIR; `ddp-out/` under a plain torchrun)."""
    path = Path(os.environ.get("FEDMQ_DDP_DIR", "ddp-out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_checkpoint(state: Mapping[str, Any], step: int) -> Path:
    """Write the restart point (rank 0's call counts; others are ignored by fedmq)."""
    return _save(out_dir() / CHECKPOINT, state, {STEP_KEY: str(int(step))})


def load_checkpoint() -> tuple[dict[str, Any], int] | None:
    """The checkpoint to resume from: fedmq's (FEDMQ_DDP_RESUME) after a restart, else None."""
    from safetensors import safe_open

    resume = os.environ.get("FEDMQ_DDP_RESUME", "")
    if not resume:
        return None
    with safe_open(resume, framework="pt") as f:
        step = int((f.metadata() or {}).get(STEP_KEY, "0"))
        return {key: f.get_tensor(key) for key in f.keys()}, step  # noqa: SIM118 - safe_open has no iteration


def save_model(state: Mapping[str, Any]) -> Path:
    """Write the final model (rank 0): the job's model once every rank has exited 0."""
    return _save(out_dir() / MODEL, state, {})


def report(step: int, metrics: Mapping[str, float], total: int | None = None) -> None:
    """Record metrics at a step or epoch (rank 0's count: all-reduce what the ranks measured first).

    `total` is how many steps there will be, for watch's progress bar. Values must be finite
    numbers; names are metric names (a letter or `_`, then letters, digits, `_` and `.`).
    """
    line = {"step": int(step), "metrics": {str(k): float(v) for k, v in metrics.items()}}
    if total is not None:
        line["total"] = int(total)
    with open(out_dir() / REPORTS, "a", encoding="utf-8") as f:  # one line per write: read whole
        f.write(json.dumps(line) + "\n")


def _save(path: Path, state: Mapping[str, Any], metadata: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial), metadata=metadata)
    os.replace(partial, path)  # whole or not at all: the learner may read it at any moment
    return path
