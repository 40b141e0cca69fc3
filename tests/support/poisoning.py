"""A digits Task in which some clients poison their updates: the test of the robust strategies.

Written only against the public contract. Clients 0 .. attackers-1 train honestly, then
replace their weights w by a poisoned version around the round's global weights w_g:

    sign_flip:  w_g − factor·(w − w_g)     (the step reversed and stretched)
    scale:      w_g + factor·(w − w_g)     (the step blown up, e.g. factor 100)

Every other client is the plain digits Task, and so is every client with `attack: none`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import Field
from torch import nn

import fedmq
from fedmq.common.task.loop import train_with_loss
from fedmq.tasks.digits import Digits, DigitsOptions


class PoisonOptions(DigitsOptions):
    attack: Literal["none", "sign_flip", "scale"] = "none"
    attackers: int = Field(3, ge=0)  # clients 0 .. attackers-1 misbehave
    factor: float = Field(1.0, gt=0)  # how far the poisoned step goes (see the module docstring)


class PoisonedDigits(Digits):
    """The digits Task, with the first `attackers` clients sending sign-flipped or scaled updates."""

    Options = PoisonOptions
    options: PoisonOptions

    def train(self, model: nn.Module, data: object, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        result = train_with_loss(self, model, data, ctx)
        if self.options.attack != "none" and ctx.client < self.options.attackers:
            poison(model, ctx.global_weights, self.step())
        return result

    def step(self) -> float:
        """c in w_g + c·(w − w_g): what the attack makes of the honest step."""
        return -self.options.factor if self.options.attack == "sign_flip" else self.options.factor


@torch.no_grad()
def poison(model: nn.Module, global_weights: Mapping[str, torch.Tensor], step: float) -> None:
    """Set each floating tensor w of the model to w_g + step·(w − w_g), in place."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            anchor = global_weights[name].to(tensor.device, tensor.dtype)
            tensor.copy_(anchor + step * (tensor - anchor))
