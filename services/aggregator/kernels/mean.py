"""Means: weighted averages of state dicts, server momentum, moving averages.

Results are folded one at a time (streaming, O(model) memory) in the order the
caller gives; callers give a canonical order (by client id) so that the result
is the same whatever order the updates arrived in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

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
    """Σ wₖ·xₖ / Σ wₖ over state dicts, folding one result at a time."""
    acc: StateDict | None = None
    dtypes: dict[str, torch.dtype] = {}
    total = 0.0
    for state, weight in results:
        if weight < 0 or not math.isfinite(weight):
            raise AggregationError(f"weight must be finite and non-negative, got {weight}")
        if acc is None:
            dtypes = {name: tensor.dtype for name, tensor in state.items()}
            acc = {
                name: tensor.to(_accumulator_dtype(tensor.dtype), copy=True).mul_(weight)
                for name, tensor in state.items()
            }
        else:
            if state.keys() != acc.keys():
                raise AggregationError("results disagree on tensor names")
            for name, tensor in state.items():
                if tensor.shape != acc[name].shape:
                    raise AggregationError(
                        f"{name}: shape {tuple(tensor.shape)} differs from {tuple(acc[name].shape)}"
                    )
                acc[name].add_(tensor.to(acc[name].dtype), alpha=weight)
        total += weight
    if acc is None:
        raise AggregationError("no results to aggregate")
    if total <= 0:
        raise AggregationError("total weight is zero")
    out: StateDict = {}
    for name, summed in acc.items():
        summed.div_(total)
        if not dtypes[name].is_floating_point and not dtypes[name].is_complex:
            summed.round_()
        out[name] = summed.to(dtypes[name])
    return out


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
