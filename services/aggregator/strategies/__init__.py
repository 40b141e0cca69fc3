"""Server strategies, one per module, built from the job spec."""

from fedmq.common.jobspec import AverageStrategy, FedAvgMStrategy, FedAvgStrategy, JobSpec
from fedmq.services.aggregator.strategies.average import Average
from fedmq.services.aggregator.strategies.base import ClientResult, Strategy
from fedmq.services.aggregator.strategies.fedavg import FedAvg
from fedmq.services.aggregator.strategies.fedavgm import FedAvgM


def build_strategy(spec: JobSpec) -> Strategy:
    match spec.strategy:
        case FedAvgStrategy():
            return FedAvg()
        case AverageStrategy():
            return Average()
        case FedAvgMStrategy(server_lr=lr, server_momentum=beta):
            return FedAvgM(server_lr=lr, server_momentum=beta)
    raise AssertionError(f"unhandled strategy {spec.strategy!r}")


__all__ = ["Average", "ClientResult", "FedAvg", "FedAvgM", "Strategy", "build_strategy"]
