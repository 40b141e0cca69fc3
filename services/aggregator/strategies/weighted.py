"""FedAvg with a weight per client set by the user (seed 002's `weighted`): missing ones count 1."""

from __future__ import annotations

from collections.abc import Sequence

from fedmq.services.aggregator.strategies.base import ClientResult
from fedmq.services.aggregator.strategies.fedavg import FedAvg


class Weighted(FedAvg):
    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = list(weights)

    def weight(self, result: ClientResult) -> float:
        return self.weights[result.client] if result.client < len(self.weights) else 1.0
