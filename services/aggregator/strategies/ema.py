"""A moving average of the global weights (seed 002's `momentum`), not FedAvgM's server momentum.

    first round:  w ← w̄ (the clients' plain average)
    then:         w ← m·w + (1 − m)·w̄
"""

from __future__ import annotations

from collections.abc import Sequence

from fedmq.services.aggregator.kernels import moving_average
from fedmq.services.aggregator.strategies.average import Average
from fedmq.services.aggregator.strategies.base import ClientResult, StateDict


class MovingAverage(Average):
    def __init__(self, momentum: float) -> None:
        self.momentum = momentum

    def aggregate(self, server_round: int, current: StateDict, results: Sequence[ClientResult]) -> StateDict:
        averaged = super().aggregate(server_round, current, results)
        return averaged if server_round == 1 else moving_average(current, averaged, self.momentum)
