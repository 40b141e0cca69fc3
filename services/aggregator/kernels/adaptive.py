"""Adaptive server optimizers: FedAdagrad, FedAdam and FedYogi (Reddi et al. 2021, Algorithm 2).

One server step, per floating tensor, with Δ the pseudo-gradient (mean of the clients' weights
minus the current weights):

    m ← β₁·m + (1 − β₁)·Δ
    v ← v + Δ²                               FedAdagrad
    v ← β₂·v + (1 − β₂)·Δ²                   FedAdam
    v ← v − (1 − β₂)·Δ²·sign(v − Δ²)         FedYogi
    w ← w + η·m / (√v + τ)

As in the paper's Algorithm 2 there is no bias correction, m starts at 0 and v at τ² (the paper
asks for v₋₁ ≥ τ²; τ² is its smallest allowed value). m and v are kept in the accumulator dtype
(float64 for float64 weights, float32 otherwise) so half-precision models keep full-precision
moments; the new weights take each tensor's own dtype. Non-floating tensors (batch counters) take
the averaged value and have no moments. Every operation is elementwise: the step is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, get_args

import torch

from fedmq.common.errors import AggregationError
from fedmq.services.aggregator.kernels.mean import StateDict

Variant = Literal["adagrad", "adam", "yogi"]
VARIANTS: tuple[str, ...] = get_args(Variant)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_hyperparameters(variant: str, eta: float, beta1: float, beta2: float, tau: float) -> None:
    if variant not in VARIANTS:
        raise AggregationError(f"unknown FedOpt variant {variant!r}: use one of {', '.join(VARIANTS)}")
    if not (math.isfinite(eta) and eta > 0):
        raise AggregationError(f"server learning rate eta must be finite and > 0, got {eta}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0 <= beta < 1:
            raise AggregationError(f"{name} must be in [0, 1), got {beta}")
    if not (math.isfinite(tau) and tau > 0):
        raise AggregationError(f"tau must be finite and > 0 (it bounds the step), got {tau}")


def _check_names(current: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor]) -> None:
    if current.keys() != averaged.keys():
        raise AggregationError("current and averaged weights disagree on tensor names")
    for name, w in current.items():
        if averaged[name].shape != w.shape:
            raise AggregationError(
                f"{name}: averaged shape {tuple(averaged[name].shape)} differs from {tuple(w.shape)}"
            )


def _moment(
    state: Mapping[str, torch.Tensor] | None, label: str, name: str, like: torch.Tensor, fill: float
) -> torch.Tensor:
    """The stored moment for `name` in `like`'s dtype, or its initial value when there is no state."""
    if state is None:
        return torch.full_like(like, fill)
    if name not in state:
        raise AggregationError(f"{label} has no tensor {name!r}: the server state does not match the model")
    if state[name].shape != like.shape:
        shape = tuple(state[name].shape)
        raise AggregationError(f"{label}[{name!r}] has shape {shape}, not {tuple(like.shape)}")
    return state[name].to(like.dtype, copy=True)


def fedopt_step(
    current: Mapping[str, torch.Tensor],
    averaged: Mapping[str, torch.Tensor],
    m: Mapping[str, torch.Tensor] | None,
    v: Mapping[str, torch.Tensor] | None,
    *,
    variant: Variant,
    eta: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[StateDict, StateDict, StateDict]:
    """One FedOpt server step. Returns (weights, m, v); pass m = v = None on the first round.

    `beta2` is unused by FedAdagrad. Inputs are never modified.
    """
    _check_hyperparameters(variant, eta, beta1, beta2, tau)
    _check_names(current, averaged)
    if (m is None) != (v is None):
        raise AggregationError("m and v are both given or both None (first round)")
    new_weights: StateDict = {}
    new_m: StateDict = {}
    new_v: StateDict = {}
    for name, w in current.items():
        if not w.dtype.is_floating_point:
            new_weights[name] = averaged[name].clone()
            continue
        acc = _accumulator_dtype(w.dtype)
        w_acc = w.to(acc, copy=True)
        delta = averaged[name].to(acc) - w_acc
        delta_sq = delta * delta
        m_t = _moment(m, "m", name, w_acc, 0.0).mul_(beta1).add_(delta, alpha=1 - beta1)
        v_t = _moment(v, "v", name, w_acc, tau * tau)
        if variant == "adagrad":
            v_t.add_(delta_sq)
        elif variant == "adam":
            v_t.mul_(beta2).add_(delta_sq, alpha=1 - beta2)
        else:
            v_t.sub_(delta_sq * torch.sign(v_t - delta_sq), alpha=1 - beta2)
        step = m_t / (v_t.sqrt() + tau)
        new_weights[name] = w_acc.add_(step, alpha=eta).to(w.dtype)
        new_m[name] = m_t
        new_v[name] = v_t
    return new_weights, new_m, new_v
