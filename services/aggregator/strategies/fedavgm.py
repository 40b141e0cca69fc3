"""FedAvgM (Hsu et al. 2019): FedAvg followed by a server step with momentum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from pydantic import Field

from fedmq.common.strategy.contract import Aggregate, ClientFailed, ClientResult, RoundContext, StateDict
from fedmq.services.aggregator.kernels import server_momentum
from fedmq.services.aggregator.strategies.fedavg import FedAvg
from fedmq.services.aggregator.strategies.options import BuiltinOptions

VELOCITY = "velocity."


class FedAvgM(FedAvg):
    class Options(BuiltinOptions):
        server_lr: float = Field(1.0, gt=0)
        server_momentum: float = Field(0.9, ge=0, lt=1)

    options: Options

    def __init__(self, options: Options | None = None) -> None:
        super().__init__(options)
        self._velocity: StateDict | None = None

    def aggregate(
        self,
        ctx: RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[ClientResult],
        failures: Sequence[ClientFailed],
    ) -> Aggregate:
        averaged = self.average(results)
        weights, self._velocity = server_momentum(
            current, averaged, self._velocity, self.options.server_lr, self.options.server_momentum
        )
        return Aggregate(weights)

    def state(self) -> StateDict:
        return {f"{VELOCITY}{k}": v for k, v in (self._velocity or {}).items()}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        velocity = {k[len(VELOCITY):]: v.clone() for k, v in state.items() if k.startswith(VELOCITY)}
        self._velocity = velocity or None
