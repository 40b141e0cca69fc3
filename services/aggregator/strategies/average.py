"""Unweighted FedAvg: every client counts the same (seed 002's `average`)."""

from __future__ import annotations

from fedmq.common.strategy.contract import ClientResult
from fedmq.services.aggregator.strategies.fedavg import FedAvg


class Average(FedAvg):
    def weight(self, result: ClientResult) -> float:
        return 1.0
