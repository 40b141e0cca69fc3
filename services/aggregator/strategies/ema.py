"""A moving average of the global weights (seed 002's `momentum`), not FedAvgM's server momentum.

    first round:  w ← w̄ (the clients' plain average)
    then:         w ← m·w + (1 − m)·w̄
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from pydantic import Field

from fedmq.common.strategy.contract import Aggregate, ClientFailed, ClientResult, RoundContext
from fedmq.services.aggregator.kernels import moving_average
from fedmq.services.aggregator.strategies.average import Average
from fedmq.services.aggregator.strategies.options import BuiltinOptions


class MovingAverage(Average):
    class Options(BuiltinOptions):
        momentum: float = Field(0.9, ge=0, lt=1)

    options: Options

    def aggregate(
        self,
        ctx: RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[ClientResult],
        failures: Sequence[ClientFailed],
    ) -> Aggregate:
        averaged = self.average(results)
        if ctx.round == 1:
            return Aggregate(averaged)
        return Aggregate(moving_average(current, averaged, self.options.momentum))
