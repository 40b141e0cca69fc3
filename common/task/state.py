"""A Task's per-client state (TrainContext.state) as tensors, for the client's next round.

A client's state is a dict of names to tensors, ints, floats and bools. After the client trains,
its learner sends it with the update, under fedmq's own prefix (updates.STATE), a kind letter
saying what each value was:

    ctx.state = {"moments": tensor, "seen": 3, "lr": 0.1, "warm": True}
        ─▶ fedmq.state.t.moments   the tensor, on the CPU
           fedmq.state.i.seen      0-d int64
           fedmq.state.f.lr        0-d float64
           fedmq.state.b.warm      0-d bool

The aggregator keeps these entries per client, as it keeps topk's residual (durable, versioned
by round, in every checkpoint); the next time the client is picked its learner gets them back and
`state_of` rebuilds the dict, each value of the kind it was given as. The engine does the same in
memory, flushed with its checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from fedmq.common.codec.updates import STATE
from fedmq.common.finite import all_finite
from fedmq.common.strategy.checks import MAX_TENSORS, NAME

if TYPE_CHECKING:
    from fedmq.common.jobspec import JobSpec

__all__ = ["check_state_entries", "keeps_state", "state_entries", "state_limit", "state_of"]

_KINDS: dict[str, tuple[type, torch.dtype]] = {"i": (int, torch.int64), "f": (float, torch.float64),
                                               "b": (bool, torch.bool)}


def keeps_state(spec: JobSpec, task: Any) -> bool:
    """Whether a job's clients keep state between rounds: its Task says so (`keeps_state`), or its
    spec keeps the loop's optimizer state or a personal model (`personalize`)."""
    return bool(spec.train.keep_optimizer_state or spec.personalize is not None
                or getattr(task, "keeps_state", False))


def state_entries(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """`state` as update entries; TypeError naming a value that is no tensor, int, float or bool."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"ctx.state keys are non-empty strings, got {name!r}")
        if isinstance(value, torch.Tensor):
            out[f"{STATE}t.{name}"] = value.detach().to("cpu", copy=True)
        elif isinstance(value, bool):  # before int: a bool is an int too
            out[f"{STATE}b.{name}"] = torch.tensor(value, dtype=torch.bool)
        elif isinstance(value, int):
            out[f"{STATE}i.{name}"] = torch.tensor(value, dtype=torch.int64)
        elif isinstance(value, float):
            out[f"{STATE}f.{name}"] = torch.tensor(value, dtype=torch.float64)
        else:
            raise TypeError(
                f"ctx.state[{name!r}] is a {type(value).__name__}: a client's state keeps tensors, ints, "
                "floats and bools (put several values in a tensor)")
    return out


def state_of(entries: Mapping[str, torch.Tensor], device: torch.device | None = None) -> dict[str, Any]:
    """The state `state_entries` made, from a client's stored entries (others are ignored); tensors
    on `device` when given."""
    out: dict[str, Any] = {}
    for key, tensor in entries.items():
        if not key.startswith(STATE):
            continue
        kind, _, name = key[len(STATE):].partition(".")
        if kind == "s":
            raise ValueError("client state still sealed: open it first (sealing.StateSealer.open)")
        if kind == "t":
            out[name] = tensor if device is None else tensor.to(device)
        else:
            out[name] = _KINDS[kind][0](tensor.item())
    return out


ENTRY_BYTES = 256  # what an entry costs beyond its values (its name, its header): counted in the limit


def check_state_entries(entries: Mapping[str, Any], limit_bytes: int) -> None:
    """ValueError unless `entries` are what `state_entries` makes: at most MAX_TENSORS, names as
    for any tensor map, known kinds, scalars as 0-d tensors of their dtype, tensors real and
    finite, `limit_bytes` in all at most (values and ENTRY_BYTES an entry)."""
    if len(entries) > MAX_TENSORS:
        raise ValueError(f"client state of {len(entries)} entries, at most {MAX_TENSORS}")
    size = 0
    for key, tensor in entries.items():
        kind, _, name = key[len(STATE):].partition(".")
        if kind == "s":  # sealed by the learners (sealing.py): only its form and size are seen here
            if (name != "sealed" or not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8
                    or tensor.dim() != 1 or len(entries) != 1):
                raise ValueError(f"{key[:80]!r} is no sealed client state (one 1-d uint8 entry, alone)")
            size += tensor.numel() + ENTRY_BYTES
            continue
        if (not NAME.match(name) or (kind != "t" and kind not in _KINDS)
                or not isinstance(tensor, torch.Tensor)):
            raise ValueError(f"{key[:80]!r} is no client state entry (names must match {NAME.pattern})")
        if kind in _KINDS and (tensor.dim() != 0 or tensor.dtype != _KINDS[kind][1]):
            want = _KINDS[kind][1]
            raise ValueError(f"{key!r} must be a 0-d {want}, not {tensor.dtype} {list(tensor.shape)}")
        bad = tensor.is_complex() or (tensor.is_floating_point() and not bool(all_finite(tensor)))
        if kind == "t" and bad:
            raise ValueError(f"ctx.state[{name!r}] holds NaN, infinity or complex values")
        size += tensor.numel() * tensor.element_size() + ENTRY_BYTES
    if size > limit_bytes:
        raise ValueError(f"client state of {size} bytes, over its limit of {limit_bytes}")


def state_limit(weights: Mapping[str, torch.Tensor]) -> int:
    """The most bytes a client's state may take: four times the model (Adam's moments are two) and 1 MiB."""
    return 4 * sum(t.numel() * t.element_size() for t in weights.values()) + (1 << 20)
