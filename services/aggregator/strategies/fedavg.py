"""FedAvg (McMahan et al. 2017): the mean of client weights, weighted by examples."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedmq.common.heap import LARGE_MODEL_BYTES
from fedmq.common.strategy.contract import (
    Aggregate,
    ClientFailed,
    ClientResult,
    RoundContext,
    StateDict,
    Strategy,
)
from fedmq.services.aggregator.kernels import weighted_mean
from fedmq.services.aggregator.kernels.mean import WeightedMean


class FedAvg(Strategy):
    def weight(self, result: ClientResult) -> float:
        """How much a client counts in the mean: its example count."""
        return float(result.num_examples)

    def average(self, results: Sequence[ClientResult]) -> StateDict:
        """The weighted mean of the results, folded one client at a time in client order."""
        return weighted_mean((r.load(), self.weight(r)) for r in results)

    def aggregate(
        self,
        ctx: RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[ClientResult],
        failures: Sequence[ClientFailed],
    ) -> Aggregate:
        if type(self).average is not FedAvg.average:  # a variant's own mean, as it computes it
            return Aggregate(self.average(results))
        # A large model's mean is computed as the round loads it into the model, tensor by tensor:
        # the new model never sits in memory whole beside the current one. Each read computes again:
        # a variant that edits the weights calls `average` (a dict). A small one's is computed at
        # once (WeightedMean.compute: a call a client, not a call a tensor a client).
        mean = WeightedMean((r.load(), self.weight(r)) for r in results)
        small = sum(t.numel() * t.element_size() for t in current.values()) < LARGE_MODEL_BYTES
        return Aggregate(mean.compute() if small else mean)
