"""SCAFFOLD's server step (Karimireddy et al. 2020, Algorithm 1, lines 16-17): new model and server control.

    x ← x + η_g · (ȳ − x)          ȳ: the mean of the round's client models (each y_i = x + Δy_i)
    c ← c + (|S|/N) · Δc̄           Δc̄: the mean of the round's control deltas c_i⁺ − c_i
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedmq.common.errors import AggregationError

StateDict = dict[str, torch.Tensor]


def scaffold_step(
    current: Mapping[str, torch.Tensor],
    averaged: Mapping[str, torch.Tensor],
    control: Mapping[str, torch.Tensor],
    averaged_delta: Mapping[str, torch.Tensor],
    server_lr: float,
    fraction: float,
) -> tuple[StateDict, StateDict]:
    """(new weights, new control). Non-float tensors take ȳ; a control not yet kept starts at zero."""
    if not 0 < fraction <= 1:
        raise AggregationError(f"the fraction of clients |S|/N must be in (0, 1], got {fraction}")
    weights: StateDict = {}
    for name, x in current.items():
        y = averaged[name]
        weights[name] = x + server_lr * (y - x) if x.dtype.is_floating_point else y.clone()
    new_control: StateDict = {}
    for name, delta in averaged_delta.items():
        c = control.get(name)
        new_control[name] = delta * fraction if c is None else c + fraction * delta
    return weights, new_control
