"""FedOpt (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2): FedAdagrad, FedAdam, FedYogi.

The clients' FedAvg mean gives a pseudo-gradient Δ = w̄ − w, and the server takes one adaptive
step with it, per coordinate:

    m ← β₁·m + (1 − β₁)·Δ
    v ← v + Δ²                              FedAdagrad
    v ← β₂·v + (1 − β₂)·Δ²                  FedAdam
    v ← v − (1 − β₂)·Δ²·sign(v − Δ²)        FedYogi
    w ← w + η·m / (√v + τ)

m starts at 0 and v at τ², with no bias correction, as in the paper; the maths is
kernels.adaptive.fedopt_step. m and v persist in `state()` so a restarted aggregator resumes
the same steps. Metrics: the pseudo-gradient's L2 norm and the server step's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from pydantic import Field

from fedmq.common.errors import AggregationError
from fedmq.common.strategy.contract import Aggregate, ClientFailed, ClientResult, RoundContext, StateDict
from fedmq.services.aggregator.kernels.adaptive import Variant, fedopt_step
from fedmq.services.aggregator.kernels.private import delta_norm
from fedmq.services.aggregator.strategies.fedavg import FedAvg
from fedmq.services.aggregator.strategies.options import BuiltinOptions

FIRST_MOMENT = "m."
SECOND_MOMENT = "v."


class FedAdagradOptions(BuiltinOptions):
    eta: float = Field(0.1, gt=0, le=10, allow_inf_nan=False)  # the server learning rate η
    beta1: float = Field(0.9, ge=0, lt=1)  # momentum of the pseudo-gradient
    tau: float = Field(1e-3, gt=0, le=1, allow_inf_nan=False)  # adaptivity: bounds the step near v = 0


class FedAdamOptions(FedAdagradOptions):
    eta: float = Field(0.01, gt=0, le=10, allow_inf_nan=False)  # smaller: v forgets, so steps stay larger
    beta2: float = Field(0.99, ge=0, lt=1)  # decay of the second moment (FedAdagrad has none)


class FedOpt(FedAvg):
    """The shared server step; a variant names its `v` update and its options."""

    variant: ClassVar[Variant]
    Options: ClassVar[type[FedAdagradOptions]] = FedAdamOptions
    options: FedAdagradOptions

    def __init__(self, options: FedAdagradOptions | None = None) -> None:
        super().__init__(options)
        self._m: StateDict | None = None
        self._v: StateDict | None = None

    def aggregate(
        self,
        ctx: RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[ClientResult],
        failures: Sequence[ClientFailed],
    ) -> Aggregate:
        averaged = self.average(results)
        options = self.options
        weights, self._m, self._v = fedopt_step(
            current, averaged, self._m, self._v, variant=self.variant, eta=options.eta,
            beta1=options.beta1, beta2=options.beta2 if isinstance(options, FedAdamOptions) else 0.0,
            tau=options.tau,
        )
        metrics = {
            "pseudo_gradient_norm": delta_norm(averaged, current),
            "server_step_norm": delta_norm(weights, current),
        }
        return Aggregate(weights, metrics=metrics)

    def state(self) -> StateDict:
        if self._m is None or self._v is None:
            return {}
        return {
            **{f"{FIRST_MOMENT}{k}": v for k, v in self._m.items()},
            **{f"{SECOND_MOMENT}{k}": v for k, v in self._v.items()},
        }

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self._m = _moment(state, FIRST_MOMENT)
        self._v = _moment(state, SECOND_MOMENT)
        if (self._m is None) != (self._v is None):
            raise AggregationError("FedOpt state holds one moment without the other (incomplete checkpoint)")


class FedAdagrad(FedOpt):
    variant = "adagrad"
    Options = FedAdagradOptions


class FedAdam(FedOpt):
    variant = "adam"
    Options = FedAdamOptions


class FedYogi(FedOpt):
    variant = "yogi"
    Options = FedAdamOptions


def _moment(state: Mapping[str, torch.Tensor], prefix: str) -> StateDict | None:
    found = {k[len(prefix):]: v.clone() for k, v in state.items() if k.startswith(prefix)}
    return found or None
