"""FedAvgM (Hsu et al. 2019): FedAvg followed by a server step with momentum."""

from __future__ import annotations

from collections.abc import Sequence

from fedmq.services.aggregator.kernels import server_momentum
from fedmq.services.aggregator.strategies.base import ClientResult, StateDict
from fedmq.services.aggregator.strategies.fedavg import FedAvg


class FedAvgM(FedAvg):
    def __init__(self, server_lr: float, server_momentum: float) -> None:
        self.server_lr = server_lr
        self.server_momentum = server_momentum
        self._velocity: StateDict | None = None

    def aggregate(
        self, server_round: int, current: StateDict, results: Sequence[ClientResult]
    ) -> StateDict:
        averaged = super().aggregate(server_round, current, results)
        weights, self._velocity = server_momentum(
            current, averaged, self._velocity, self.server_lr, self.server_momentum
        )
        return weights

    def state(self) -> StateDict:
        return {f"velocity.{k}": v for k, v in (self._velocity or {}).items()}

    def load_state(self, state: StateDict) -> None:
        prefix = "velocity."
        velocity = {k[len(prefix):]: v.clone() for k, v in state.items() if k.startswith(prefix)}
        self._velocity = velocity or None
