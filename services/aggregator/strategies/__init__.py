"""Server strategies, one per module, built from the job spec."""

from fedmq.common.jobspec import (
    AverageStrategy,
    FedAvgMStrategy,
    FedAvgStrategy,
    JobSpec,
    MovingAverageStrategy,
    WeightedStrategy,
)
from fedmq.services.aggregator.strategies.average import Average
from fedmq.services.aggregator.strategies.base import ClientResult, Strategy
from fedmq.services.aggregator.strategies.ema import MovingAverage
from fedmq.services.aggregator.strategies.fedavg import FedAvg
from fedmq.services.aggregator.strategies.fedavgm import FedAvgM
from fedmq.services.aggregator.strategies.weighted import Weighted


def build_strategy(spec: JobSpec) -> Strategy:
    match spec.strategy:
        case FedAvgStrategy():
            return FedAvg()
        case AverageStrategy():
            return Average()
        case FedAvgMStrategy(server_lr=lr, server_momentum=beta):
            return FedAvgM(server_lr=lr, server_momentum=beta)
        case WeightedStrategy(weights=weights):
            return Weighted(weights)
        case MovingAverageStrategy(momentum=momentum):
            return MovingAverage(momentum)
    raise AssertionError(f"unhandled strategy {spec.strategy!r}")


__all__ = [
    "Average", "ClientResult", "FedAvg", "FedAvgM", "MovingAverage", "Strategy", "Weighted", "build_strategy",
]
