"""FedProx (Li et al. 2020): FedAvg on the server; on each client a proximal term mu/2·||w − w_global||².

The term is the clients' to add: the round config carries ``proximal_mu``, which fedmq's
training loop applies for a loss-level Task and a Task with its own `train` reads from
`ctx.config` (the Strategy contract's docstring shows how). With mu = 0 it is FedAvg exactly.
"""

from __future__ import annotations

from pydantic import Field

from fedmq.common.strategy.contract import PROXIMAL_MU, Config, RoundContext
from fedmq.services.aggregator.strategies.fedavg import FedAvg
from fedmq.services.aggregator.strategies.options import BuiltinOptions


class FedProx(FedAvg):
    class Options(BuiltinOptions):
        mu: float = Field(0.01, ge=0)

    options: Options

    def configure(self, ctx: RoundContext) -> Config:
        return {PROXIMAL_MU: self.options.mu}
