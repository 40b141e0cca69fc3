"""Model files on disk: safetensors (no pickle), with the job spec in the metadata.

Load a trained model anywhere torch and fedmq are installed:

    import fedmq
    model = fedmq.load_model(".fedmq/aggregator/<job>/model.safetensors")   # an nn.Module, eval mode

or just the tensors, without fedmq: `safetensors.torch.load_file(path)`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmq.common import statefiles
from fedmq.common.errors import ConfigError, DecodeError

if TYPE_CHECKING:
    import torch

SPEC_KEY = "fedmq.job_spec"
_OS_ERROR = re.compile(r"os error (\d+)")


def save_state(
    path: str | Path, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
    sync: bool = True,
) -> Path:
    """Write atomically and durably (statefiles; `sync`: fsynced): a crash or a full disk never
    leaves half a file.

    A failed write raises StateUnwritable naming the path and errno; the old file is untouched.
    """
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}

    def produce(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp), metadata=dict(metadata or {}))
        except Exception as exc:  # safetensors reports I/O errors as its own type, errno in the text
            found = _OS_ERROR.search(str(exc))
            if found is None:
                raise
            code = int(found[1])
            raise OSError(code, os.strerror(code), str(tmp)) from exc

    statefiles.atomic_file(path, produce, sync)
    return path


def load_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read tensors and metadata; a damaged file raises DecodeError."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (OSError, ValueError, RuntimeError) as exc:
        raise DecodeError(f"cannot read checkpoint {path}: {exc}") from None
    return tensors, metadata


def save_model(path: str | Path, state: Mapping[str, torch.Tensor], spec_json: str, **extra: Any) -> Path:
    metadata = {SPEC_KEY: spec_json, **{f"fedmq.{k}": json.dumps(v) for k, v in extra.items()}}
    return save_state(path, state, metadata)


def load_model(path: str | Path) -> torch.nn.Module:
    """Rebuild the job's model with its Task (named in the spec stored in the file) and load the weights."""
    from fedmq.common.jobspec import JobSpec
    from fedmq.common.task.runtime import TaskRuntime

    state, metadata = load_state(path)
    if SPEC_KEY not in metadata:
        raise DecodeError(f"{path} has no fedmq job spec in its metadata")
    spec = JobSpec.model_validate_json(metadata[SPEC_KEY])
    if spec.ddp is not None:
        raise ConfigError(
            f"{path} is a DDP job's model ({spec.ddp.entry}): fedmq has no Task to build it with; load "
            "its tensors with safetensors.torch.load_file(path) into your own model"
        )
    model = TaskRuntime.for_job(spec).build_model()
    model.load_state_dict(state)
    return model.eval()
