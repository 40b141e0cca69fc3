"""A fused step's gradients, recorded once per input layout and replayed as the aten operations it ran.

    eager     vmap(loss) over the group's rows, then autograd: per step, vmap's batching in Python,
              functional_call swapping the model's weights, the autograd engine. For a small model
              that is most of a step (measured: 1.75 ms of a 10-client digits step, against 0.9 ms
              for the same operations replayed).
    recorded  torch.fx's make_fx runs the eager function once with real tensors and records every
              aten operation below vmap and autograd (the batched products, the backward's own
              operations) into a graph; later steps with the same layout call that graph.

A replay calls the same operations on the same inputs as the eager run it recorded, so the same
bits (tests/unit/test_traced.py checks it against eager runs): whether a step was replayed never
changes a result, only its time, and a learner that trains one client agrees with the engine that
trains ten. What a recording bakes in is the Python around the operations: branches on shapes
(the key has them), constants, and any state of the Task's the loss reads. So a fused loss must be a
function of the weights and the batch alone, as vmap already asks of it (no random numbers, no
reading a tensor's value in Python).

A layout (every input's shape, strides, dtype and device, and the structure that holds them) is
recorded the RECORD_AT-th time it comes, at most MAX_GRAPHS per model; past that, new layouts stay
eager. Recording costs ~0.2 s (measured here; the first in a process ~1.5 s, with make_fx's
imports), about a hundred eager steps of a small model: a layout seen eight times is one a job
keeps coming back to (each round's), and one seen once or twice (ragged last batches of a short
job) is not worth it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["MAX_GRAPHS", "RECORD_AT", "replayed"]

RECORD_AT = 8  # the sighting of a layout that records it
MAX_GRAPHS = 32  # recordings kept per model

_Entry = int | Callable[..., Any] | None  # sightings so far, a recording, or None: stays eager


class _Recordings:
    """One model's recordings and sightings, by layout."""

    def __init__(self) -> None:
        self.entries: dict[Any, _Entry] = {}
        self.graphs = 0


_BY_MODEL: weakref.WeakKeyDictionary[torch.nn.Module, _Recordings] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # recording swaps global dispatch state: one at a time


def replayed(model: torch.nn.Module, what: Hashable, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`: eager, or a recording of it made on an earlier call with this layout of `args`.

    `what` names `fn` with every Python value it reads (a DP clip norm): with one `model` and one
    `what`, `fn` must be the same function of `args`. It may change its input tensors in place
    (BatchNorm's running statistics): a replay does too."""
    recordings = _BY_MODEL.get(model)
    if recordings is None:
        recordings = _BY_MODEL.setdefault(model, _Recordings())
    key = what, _layout(args)
    entry = recordings.entries.get(key, 0)
    if entry is not None and not callable(entry):
        if entry + 1 >= RECORD_AT and recordings.graphs < MAX_GRAPHS:
            with _LOCK:
                entry = _record(fn, args)
            recordings.graphs += entry is not None
        else:
            entry += 1
        recordings.entries[key] = entry
    return entry(*args) if callable(entry) else fn(*args)


def _record(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any] | None:
    """A graph of `fn`'s aten operations, recorded on copies of `args` (a failure midway leaves
    them as they were); None when make_fx cannot follow it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    copies = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args)
    if _layout(copies) != _layout(args):  # an input clone cannot copy (stride 0): its kernels may differ
        return None
    try:
        graph = make_fx(lambda *inputs: fn(*inputs))(*copies)  # make_fx reads a method's signature wrong
    except Exception:  # noqa: BLE001 - anything make_fx cannot record (or `fn`'s own error) runs eager
        return None
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph


def _layout(args: Any) -> Any:
    leaves, spec = tree_flatten(args)
    return spec, tuple(
        (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor)
        else (type(t), t)
        for t in leaves
    )
