"""SCAFFOLD's client side (Karimireddy et al. 2020, Algorithm 1, option II): one round's controls.

The strategy sends the server control c and the client's own c_i in `ctx.client_state`
(``c.<param>``, ``c_i.<param>``; absent means zero). Each local step uses the corrected gradient

    y ← y − lr·(g(y) − c_i + c)

and after K steps from the global weights x the client's new control and what it sends back are

    c_i⁺ = c_i − c + (x − y)/(K·lr)        extras  dc.<param> = c_i⁺ − c_i = (x − y)/(K·lr) − c

Option II reads (x − y)/(K·lr) as the mean gradient, which holds for plain SGD steps only: Adam
and momentum are refused. SGD's weight decay is part of the gradient and is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from fedmq.common.strategy.contract import SCAFFOLD

if TYPE_CHECKING:
    from fedmq.common.task.contract import TrainContext

SERVER = "c."  # the server control c, per parameter, in the client state
CLIENT = "c_i."  # the client's control c_i
DELTA = "dc."  # c_i⁺ − c_i, in TrainResult.extras


class Controls:
    """The controls of one client's round: correct each step's gradients, then the extras to send."""

    def __init__(
        self, model: nn.Module, global_weights: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor], lr: float,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"SCAFFOLD needs a positive learning rate, got {lr}")
        self.lr = lr
        self.steps = 0
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.start: dict[str, torch.Tensor] = {}
        self.server: dict[str, torch.Tensor] = {}
        self.correction: dict[str, torch.Tensor] = {}
        for name, p in self.params:
            if name not in global_weights:
                raise KeyError(f"SCAFFOLD: parameter {name!r} is not in the global weights")
            self.start[name] = global_weights[name].detach().to(p.device, p.dtype)
            c = _control(state, SERVER + name, p)
            self.server[name] = c
            self.correction[name] = c - _control(state, CLIENT + name, p)

    @classmethod
    def for_round(cls, model: nn.Module, ctx: TrainContext) -> Controls | None:
        """The round's controls when the strategy asks for SCAFFOLD (None otherwise); plain SGD only."""
        if not ctx.config.get(SCAFFOLD):
            return None
        train = ctx.train
        if train.optimizer != "sgd" or train.momentum != 0:
            raise ValueError(
                f"SCAFFOLD (option II) needs plain SGD steps; this job trains with {train.optimizer} "
                f"(momentum {train.momentum}): set train.optimizer: sgd and train.momentum: 0"
            )
        return cls(model, ctx.global_weights, ctx.client_state, train.lr)

    @torch.no_grad()
    def correct(self) -> None:
        """Add c − c_i to every parameter's gradient: call after backward(), before the step."""
        for name, p in self.params:
            if p.grad is None:
                p.grad = self.correction[name].clone()  # g = 0 for a parameter the loss did not use
            else:
                p.grad.add_(self.correction[name])
        self.steps += 1

    @torch.no_grad()
    def extras(self) -> dict[str, torch.Tensor]:
        """``dc.<param>`` = (x − y)/(K·lr) − c for the K corrected steps taken (on the CPU)."""
        if self.steps == 0:
            raise ValueError("SCAFFOLD: no training step was taken, so there is no control update")
        scale = 1.0 / (self.steps * self.lr)
        return {
            DELTA + name: (self.start[name] - p).mul_(scale).sub_(self.server[name]).cpu()
            for name, p in self.params
        }


def _control(state: Mapping[str, torch.Tensor], key: str, p: torch.Tensor) -> torch.Tensor:
    """The control `key` on the parameter's device and dtype; zeros when not sent yet."""
    value = state.get(key)
    if value is None:
        return torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
    if value.shape != p.shape:
        raise ValueError(f"SCAFFOLD: {key} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}")
    return value.detach().to(p.device, p.dtype)
