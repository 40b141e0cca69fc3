"""Means: weighted averages of state dicts, server momentum, moving averages.

Results are folded in the order the caller gives, one tensor at a time (a mean read
tensor by tensor holds one tensor of it); callers give a canonical order (by client id)
so that the result is the same whatever order the updates arrived in.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Generator, Iterable, Iterator, Mapping

import torch

from fedmq.common.errors import AggregationError

StateDict = dict[str, torch.Tensor]


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return torch.complex128
    if dtype == torch.float64:
        return torch.float64
    if dtype.is_floating_point:
        return torch.float32
    return torch.float64  # integer buffers (e.g. batch counters) averaged, then rounded


def weighted_mean(results: Iterable[tuple[Mapping[str, torch.Tensor], float]]) -> StateDict:
    """Σ wₖ·xₖ / Σ wₖ over state dicts (see WeightedMean), all computed now."""
    return WeightedMean(results).compute()


class WeightedMean(Mapping[str, torch.Tensor]):
    """Σ wₖ·xₖ / Σ wₖ over state dicts, each tensor computed when it is read: folded over the results
    in their order, reading that tensor of each result only, so a mean read tensor by tensor holds
    one tensor of it, never a whole model beside the one it replaces.

    Each tensor's arithmetic is the same whether it is read alone or with all the others (the same
    operations, per element, in the same order): the bits do not depend on how it is read. Reading
    one twice computes it twice.

    The kernel reads nothing itself: results of one type that says how a column of them is read
    (`read_column(states, name)`: codec.TensorFile, the aggregator's stored updates, reads large
    tensors ahead on other threads) are read that way, others one lookup at a time. Results whose
    lookups are their reader's own (`owned_reads`) give the first tensor to become the sum without
    a copy.
    """

    def __init__(self, results: Iterable[tuple[Mapping[str, torch.Tensor], float]]) -> None:
        self._results = list(results)
        if not self._results:
            raise AggregationError("no results to aggregate")
        total = 0.0
        for state, weight in self._results:
            if weight < 0 or not math.isfinite(weight):
                raise AggregationError(f"weight must be finite and non-negative, got {weight}")
            if state.keys() != self._results[0][0].keys():
                raise AggregationError("results disagree on tensor names")
            total += weight
        if total <= 0:
            raise AggregationError("total weight is zero")
        self._total = total
        self._owned = all(getattr(state, "owned_reads", False) for state, _ in self._results)

    def __getitem__(self, name: str) -> torch.Tensor:
        with contextlib.closing(self._tensors(name)) as tensors:  # a failure drops the reads ahead
            return self._fold(name, tensors)

    def _fold(self, name: str, tensors: Iterator[torch.Tensor]) -> torch.Tensor:
        weights = (weight for _, weight in self._results)
        tensor = next(tensors)
        dtype = tensor.dtype
        # A file's read is this fold's own: it may become the sum. Else (a view of a message, a
        # model's own tensor) the sum is a copy.
        acc = tensor.to(_accumulator_dtype(dtype), copy=not self._owned).mul_(next(weights))
        del tensor  # a result read from disk: its buffer goes now, not after the fold
        for tensor, weight in zip(tensors, weights, strict=True):
            if tensor.shape != acc.shape:
                raise AggregationError(f"{name}: shape {tuple(tensor.shape)} differs from {tuple(acc.shape)}")
            acc.add_(tensor.to(acc.dtype), alpha=weight)
            del tensor
        acc.div_(self._total)
        if not dtype.is_floating_point and not dtype.is_complex:
            acc.round_()
        return acc.to(dtype)

    def compute(self) -> StateDict:
        """Every tensor, computed now. When the results are dicts of tensors held in memory, their
        float32 and float64 CPU tensors that agree in dtype and shape are folded together: one
        `torch._foreach_*` call a result, not one call a tensor a result. On the CPU these run each
        tensor's own `add_`: the same bits as reading them one by one. The rest are read one by one."""
        first = self._results[0][0]
        held = all(type(state) is dict for state, _ in self._results)  # not files, nor computed per lookup
        together = [name for name in first if self._foldable(name)] if held else []
        out: StateDict = {}
        if together:
            (state, weight), *rest = self._results
            sums = torch._foreach_mul([state[name] for name in together], weight)
            for state, weight in rest:
                torch._foreach_add_(sums, [state[name] for name in together], alpha=weight)
            torch._foreach_div_(sums, self._total)
            out = dict(zip(together, sums, strict=True))
        return {name: out[name] if name in out else self[name] for name in first}

    def _foldable(self, name: str) -> bool:
        """Whether tensor `name` is a float32 or float64 CPU tensor of one dtype and shape in every result."""
        first = self._results[0][0][name]
        if first.dtype not in (torch.float32, torch.float64) or first.device.type != "cpu":
            return False
        return all(
            (t := state[name]).dtype == first.dtype and t.shape == first.shape and t.device.type == "cpu"
            for state, _ in self._results
        )

    def _tensors(self, name: str) -> Generator[torch.Tensor]:
        """Each result's tensor `name`, in the results' order: read as their type reads a column,
        when they are all of one type that says how."""
        states = [state for state, _ in self._results]
        kind = type(states[0])
        read_column = getattr(kind, "read_column", None)
        if read_column is not None and all(type(state) is kind for state in states):
            column: Generator[torch.Tensor] = read_column(states, name)
            return column
        return (state[name] for state in states)

    def __iter__(self) -> Iterator[str]:
        return iter(self._results[0][0])

    def __len__(self) -> int:
        return len(self._results[0][0])

    def __contains__(self, name: object) -> bool:
        return name in self._results[0][0]  # Mapping's default would compute the tensor


def server_momentum(
    current: Mapping[str, torch.Tensor],
    averaged: Mapping[str, torch.Tensor],
    velocity: Mapping[str, torch.Tensor] | None,
    lr: float,
    momentum: float,
) -> tuple[StateDict, StateDict]:
    """FedAvgM (Hsu et al. 2019): v ← βv + (w − w̄); w ← w − η·v. Returns (weights, velocity)."""
    new_weights: StateDict = {}
    new_velocity: StateDict = {}
    for name, w in current.items():
        if not w.dtype.is_floating_point:
            new_weights[name] = averaged[name].clone()
            continue
        step = w - averaged[name]
        if velocity is not None and name in velocity:
            step = velocity[name].mul(momentum).add_(step)
        new_velocity[name] = step
        new_weights[name] = w - lr * step
    return new_weights, new_velocity


def moving_average(
    previous: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor], momentum: float
) -> StateDict:
    """w ← m·w_prev + (1 − m)·w̄ per floating tensor (seed 002's `momentum`); other tensors take w̄."""
    out: StateDict = {}
    for name, avg in averaged.items():
        prev = previous[name]
        out[name] = prev * momentum + avg * (1 - momentum) if avg.dtype.is_floating_point else avg.clone()
    return out
