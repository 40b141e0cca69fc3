"""FedAvg with a weight per client set by the user (seed 002's `weighted`): missing ones count 1."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from fedmq.common.strategy.contract import ClientResult
from fedmq.services.aggregator.strategies.fedavg import FedAvg
from fedmq.services.aggregator.strategies.options import BuiltinOptions


class Weighted(FedAvg):
    class Options(BuiltinOptions):
        weights: list[Annotated[float, Field(ge=0)]] = []

    options: Options

    def weight(self, result: ClientResult) -> float:
        weights = self.options.weights
        return weights[result.client] if result.client < len(weights) else 1.0
