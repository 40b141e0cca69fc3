"""FedAvg (McMahan et al. 2017): the mean of client weights, weighted by examples."""

from __future__ import annotations

from collections.abc import Sequence

from fedmq.services.aggregator.kernels import weighted_mean
from fedmq.services.aggregator.strategies.base import ClientResult, StateDict, Strategy


class FedAvg(Strategy):
    def weight(self, result: ClientResult) -> float:
        return float(result.num_examples)

    def aggregate(
        self, server_round: int, current: StateDict, results: Sequence[ClientResult]
    ) -> StateDict:
        return weighted_mean((r.load(), self.weight(r)) for r in results)
