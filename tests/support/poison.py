"""A learner that holds valid credentials and lies: the digits Task, trained honestly, then its
update boosted or its example count inflated for chosen clients. Named in a spec like any Task:

    task: {name: "tests.support.poison:Poisoned", options: {poisoned: [0, 3], scale: 100.0}}

`scale` multiplies the delta (w_trained − w_global) of the poisoned clients' updates (a model
replacement attack, Bagdasaryan et al. 2020); `inflate` multiplies their reported example count
from round `inflate_from` on (a weight-stealing attack; the first rounds report honestly, so the
aggregator has seen the true count). Everything else is the digits Task's.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

import fedmq
from fedmq.common.task.loop import train_with_loss
from fedmq.tasks.digits import Digits, DigitsOptions


class PoisonOptions(DigitsOptions):
    poisoned: list[int] = []  # the clients whose updates lie
    scale: float = Field(1.0, gt=0)  # their deltas times this
    inflate: int = Field(1, gt=0)  # their example counts times this
    inflate_from: int = Field(1, gt=0)  # from this round on


class Poisoned(Digits):
    Options = PoisonOptions
    options: PoisonOptions

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        result = train_with_loss(self, model, data, ctx)
        if ctx.client not in self.options.poisoned:
            return result
        if self.options.scale != 1.0:
            with torch.no_grad():
                for name, value in model.state_dict().items():
                    if value.is_floating_point():
                        base = ctx.global_weights[name].to(value.device, value.dtype)
                        value.copy_(base + self.options.scale * (value - base))
        count = result.num_examples
        if ctx.round >= self.options.inflate_from:
            count *= self.options.inflate
        return fedmq.TrainResult(count, result.metrics, result.extras)
