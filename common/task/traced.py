"""A fused step's gradients, recorded once per input layout and replayed as the aten operations it ran.

    eager     vmap(loss) over the group's rows, then autograd: per step, vmap's batching in Python,
              functional_call swapping the model's weights, the autograd engine. For a small model
              that is most of a step (measured: 1.7 ms of a 10-client digits step, against 0.9 ms
              for the same operations replayed).
    record    the eager function runs once (on copies of its inputs) under a TorchDispatchMode,
              which sees every aten operation below vmap and autograd (the batched products, the
              backward's own operations) and writes them down as straight-line Python: one call a
              line, each operation's tensors named by where they came from (an input, an earlier
              operation's output, or a constant of the function's: a tensor it holds)
    replay    that code, compiled once; a variable is dropped after its last use, as eager drops it

A replay calls the same operations with the same arguments as the eager run, so it gives the same
bits, and whether a step was replayed never changes a result, only its time: a learner that trains
one client agrees with the engine that trains ten. Every recording is checked once on the next
call with its layout, against an eager run on copies, bit for bit (outputs and changed inputs);
one that differs is dropped and the layout stays eager. What a recording bakes in is the Python
around the operations: branches on shapes (the key has them), Python numbers, tensors the function
made itself. So a fused loss must be a function of the weights and the batch alone, as vmap
already asks of it (no random numbers, no reading a tensor's value in Python).

A layout (every input's shape, strides, dtype and device, and the structure that holds them) is
recorded the RECORD_AT-th time it comes, at most MAX_GRAPHS per model; past that, new layouts stay
eager. Recording costs about ten eager steps (measured: 13-15 ms for a digits step); torch.fx's
make_fx, which records the same operations, took 0.2 s a layout, which a short job's ragged
layouts never paid back.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["MAX_GRAPHS", "RECORD_AT", "numbers_of", "replayed"]

RECORD_AT = 2  # the sighting of a layout that records it
MAX_GRAPHS = 64  # recordings kept per model
MAX_LAYOUTS = 4096  # layouts counted per model (past that, a new one runs eager uncounted)


@dataclass
class _Replay:
    run: Callable[..., Any]
    checked: bool = False


_Entry = int | _Replay | None  # sightings so far, a recording, or None: stays eager


@dataclass
class _Recordings:
    """One model's recordings and sightings, by layout."""

    entries: dict[Any, _Entry] = field(default_factory=dict)

    @property
    def graphs(self) -> int:
        """Recordings kept (read when one more would be made: rarely)."""
        return sum(isinstance(entry, _Replay) for entry in self.entries.values())


_BY_MODEL: weakref.WeakKeyDictionary[torch.nn.Module, _Recordings] = weakref.WeakKeyDictionary()


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
    if isinstance(entry, _Replay):
        if entry.checked:
            return entry.run(*args)
        return _checked(recordings, key, entry, fn, args)
    if entry is not None and (entry or len(recordings.entries) < MAX_LAYOUTS):
        if entry + 1 >= RECORD_AT:  # recorded, or (past MAX_GRAPHS, or unrecordable) eager for good
            run = _record(fn, args) if recordings.graphs < MAX_GRAPHS else None
            entry = None if run is None else _Replay(run)
        else:
            entry += 1
        recordings.entries[key] = entry
    return fn(*args)


def numbers_of(owner: Any) -> tuple[tuple[str, Any], ...]:
    """`owner`'s own attributes that are Python numbers, strings, booleans or None, by name: for a
    `what` of `replayed`, so that a loss reading `self.scale` gets another recording when it changes."""
    found = getattr(owner, "__dict__", {})
    return tuple(sorted((name, value) for name, value in found.items()
                        if value is None or isinstance(value, bool | int | float | str)))


def _checked(recordings: _Recordings, key: Any, entry: _Replay, fn: Callable[..., Any], args: Any) -> Any:
    """The first replay of a recording, against an eager run on copies of `args`: the replay's
    result if every output and every input it changed has the eager bits; else the eager result
    (and its changes to the inputs), and the layout stays eager."""
    try:
        copies = _copies(args)
        expected = fn(*copies)
        got = entry.run(*args)
    except torch.OutOfMemoryError:  # the check holds the inputs twice: without room, eager only
        recordings.entries[key] = None
        return fn(*args)
    if _same((got, args), (expected, copies)):
        entry.checked = True
        return got
    recordings.entries[key] = None
    with torch.no_grad():
        for mine, theirs in zip(tree_flatten(args)[0], tree_flatten(copies)[0], strict=True):
            if isinstance(mine, torch.Tensor):
                mine.copy_(theirs)
    return expected


def _same(a: Any, b: Any) -> bool:
    flat_a, spec_a = tree_flatten(a)
    flat_b, spec_b = tree_flatten(b)
    return spec_a == spec_b and all(
        _equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(flat_a, flat_b, strict=True)
    )


def _equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The same bits: dtype, shape, strides and every value's bit pattern (−0.0 is not +0.0; a
    NaN is equal to a NaN of the same payload: a diverged step replays as it ran)."""
    if x.dtype != y.dtype or x.shape != y.shape or x.stride() != y.stride():
        return False
    if x.is_floating_point():
        bits = _BITS[x.element_size()]
        return torch.equal(x.view(bits), y.view(bits))
    return torch.equal(x, y)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copies(args: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args)


class _Unrecordable(Exception):
    """An operation whose result is no tensor (a value read into Python), or that draws random
    numbers (a replay would draw them twice where eager draws once): the layout stays eager."""


class _Recorder(TorchDispatchMode):
    """Writes each aten operation down as a line of Python over numbered tensors."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here runs under torch.compile. True (torch's default) wraps __torch_dispatch__ in
        # dynamo's disable, which imports torch._dynamo at the first recorded operation: 1.7-2.2 s
        # of a process's first fused round here.
        return False

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.tensors: list[torch.Tensor] = list(inputs)  # kept alive: an id stays theirs
        self.where = {id(t): i for i, t in enumerate(inputs)}
        self.constants: dict[str, Any] = {}
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []  # each tensor constant as first seen
        self.tensor_names: dict[int, str] = {}
        self.lines: list[tuple[str, list[int], list[int], bool]] = []  # code, reads, writes, droppable

    def name(self, t: torch.Tensor, reads: list[int]) -> str:
        i = self.where.get(id(t))
        if i is None or self.tensors[i] is not t:  # not made by a recorded operation: a constant
            return self.constant(t)
        reads.append(i)
        return f"v{i}"

    def constant(self, value: Any) -> str:
        if value is None or isinstance(value, bool | int | str):
            return repr(value)
        if isinstance(value, torch.Tensor):  # shared by every replay: it must never change (`unchanged`)
            if (known := self.tensor_names.get(id(value))) is not None:
                return known
            self.snapshots.append((value, value.clone()))
        name = f"c{len(self.constants)}"
        self.constants[name] = value
        if isinstance(value, torch.Tensor):
            self.tensor_names[id(value)] = name  # kept alive by `constants`: the id stays its own
        return name

    def unchanged(self, returned: list[torch.Tensor]) -> None:
        """Refuses a recording whose tensor constants changed (written in place: a replay would write
        them again) or that returns one (a caller that changes it would change every replay's)."""
        for value, first in self.snapshots:
            if not _equal(value, first):
                raise _Unrecordable("it changes a tensor of its own in place")
        shared = {value.untyped_storage().data_ptr() for value, _ in self.snapshots if value.numel()}
        for t in returned:
            made = (i := self.where.get(id(t))) is not None and self.tensors[i] is t
            if not made or (t.numel() and t.untyped_storage().data_ptr() in shared):
                raise _Unrecordable("it returns a tensor of its own")

    def render(self, value: Any, reads: list[int]) -> str:
        if isinstance(value, torch.Tensor):
            return self.name(value, reads)
        if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
            inner = ", ".join(self.render(v, reads) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner},)"
        return self.constant(value)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        reads: list[int] = []
        call = ", ".join([self.render(a, reads) for a in args]
                         + [f"{k}={self.render(v, reads)}" for k, v in kwargs.items()])
        if torch.Tag.nondeterministic_seeded in func.tags:  # a replay would draw again: eager
            raise _Unrecordable(f"{func} draws random numbers")
        out = func(*args, **kwargs)
        outs = list(out) if isinstance(out, tuple | list) else [out]
        writes = []
        for o in outs:
            if o is not None and not isinstance(o, torch.Tensor):
                raise _Unrecordable(f"{func} gave a {type(o).__name__}")
            if o is not None:
                i = self.where.get(id(o))
                if i is None or self.tensors[i] is not o:
                    i = len(self.tensors)
                    self.tensors.append(o)
                    self.where[id(o)] = i
                writes.append(i)
            else:
                writes.append(-1)
        op = self.constant(func._op)  # the operator itself: OpOverload.__call__ is a Python frame more
        if isinstance(out, tuple | list):
            names = ", ".join("_" if w < 0 else f"v{w}" for w in writes)
            code = f"{names}{',' if len(writes) == 1 else ''} = {op}({call})"
        else:
            code = f"{'_' if writes[0] < 0 else f'v{writes[0]}'} = {op}({call})"
        # Dropped when unused: only a view or a pointwise operation that writes nothing (some that do
        # write are not marked so: native_batch_norm updates its running statistics).
        droppable = (not func._schema.is_mutable and (func.is_view or torch.Tag.pointwise in func.tags)
                     and all(w >= 0 for w in writes))
        self.lines.append((code, reads, [w for w in writes if w >= 0], droppable))
        return out


def _record(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any] | None:
    """`fn` as straight-line code over `args`' tensors, recorded on copies of them (a failure midway
    leaves `args` as they were); None when it cannot be recorded (it then runs eager, and raises
    there if it must)."""
    copies = _copies(args)
    if _layout(copies) != _layout(args):  # an input clone cannot copy (stride 0): its kernels may differ
        return None
    flat, _ = tree_flatten(copies)
    inputs = [t for t in flat if isinstance(t, torch.Tensor)]
    recorder = _Recorder(inputs)
    gpus = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=gpus), recorder:  # what it drew before it failed, undrawn
            out = fn(*copies)
        flat_out, out_spec = tree_flatten(out)
        recorder.unchanged([t for t in flat_out if isinstance(t, torch.Tensor)])
        results: list[int] = []
        returned = ", ".join(recorder.render(o, results) if isinstance(o, torch.Tensor)
                             else recorder.constant(o) for o in flat_out)
    except Exception:  # noqa: BLE001 - anything it cannot record, or `fn`'s own error: eager
        return None
    body = _live(recorder.lines, set(results), len(inputs))
    names = ", ".join(f"v{i}" for i in range(len(inputs)))
    source = "\n    ".join([f"def replay({names}):", *body, f"return [{returned}]"])
    scope = dict(recorder.constants)
    exec(compile(source, "<fedmq.traced>", "exec"), scope)  # noqa: S102 - code written above, from aten calls
    compiled = scope["replay"]

    def run(*call_args: Any) -> Any:
        tensors = [t for t in tree_flatten(call_args)[0] if isinstance(t, torch.Tensor)]
        with torch.no_grad():  # the recorded operations are autograd's own already
            return tree_unflatten(compiled(*tensors), out_spec)

    return run


def _live(lines: list[tuple[str, list[int], list[int], bool]], results: set[int], inputs: int) -> list[str]:
    """The lines whose outputs are used, and every line that is not a pure view or pointwise
    operation, each variable dropped after its last use."""
    needed = set(results)
    kept = []
    for code, reads, writes, droppable in reversed(lines):
        if not droppable or needed.intersection(writes):
            kept.append((code, reads, writes))
            needed.update(reads)
    kept.reverse()
    last: dict[int, int] = {}
    for at, (_, reads, writes) in enumerate(kept):
        for i in itertools.chain(reads, writes):
            last[i] = at
    body = []
    for at, (code, reads, writes) in enumerate(kept):
        body.append(code)
        done = sorted({i for i in itertools.chain(reads, writes) if last[i] == at and i not in results})
        if done:
            body.append("del " + ", ".join(f"v{i}" for i in done))
    return body


def _layout(args: Any) -> Any:
    leaves, spec = tree_flatten(args)
    return spec, tuple(
        (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor)
        else (type(t), t)
        for t in leaves
    )
