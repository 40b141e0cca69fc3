"""Norm clipping around any strategy: each client's update is bounded before the inner strategy sees it.

    Δₖ = wₖ − w,   wₖ ← w + Δₖ·min(1, C/‖Δₖ‖)        ‖·‖: L2 over all floating tensors together

then the inner strategy aggregates the clipped weights as if clients had sent them. A defence
against scaled (boosted) updates (Sun et al. 2019, "Can You Really Backdoor Federated
Learning?"), and DP-FedAvg's clipping without its noise. The job names it as

    strategy: {name: clipped, options: {inner: {name: median}, max_norm: 2.0}}

The inner spec is read and checked by the same code as a job's own `strategy`, so it may be any
built-in or `package.module:Class`. configure, state, load_state and client state are the inner
strategy's; the wrapper keeps nothing across rounds.

Memory: one pass reads each client's update once, tensor by tensor, for its norm; the inner
strategy then reads lazily clipped tensors (each computed in float64 when looked up), so a robust
inner strategy still holds k times one tensor, not k models. Non-floating tensors pass unchanged.
The clipped delta is bounded by C before the weights are rounded to each tensor's dtype.
Metrics: the inner strategy's, with clip_clients_clipped, clip_norm_mean and clip_norm_max
(the norms before clipping).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import torch
from pydantic import Field, field_validator

from fedmq.common.allowlist import CodeNotAllowed
from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import StrategySpec
from fedmq.common.strategy.contract import (
    Aggregate,
    ClientFailed,
    ClientResult,
    Config,
    JobFacts,
    RoundContext,
    StateDict,
    Strategy,
    StrategyOptions,
)
from fedmq.common.strategy.loading import make_strategy, strategy_class, strategy_options
from fedmq.services.aggregator.kernels.clip import ClippedWeights
from fedmq.services.aggregator.kernels.private import delta_norm
from fedmq.services.aggregator.strategies.options import BuiltinOptions


class ClippedOptions(BuiltinOptions):
    inner: StrategySpec = StrategySpec()  # the strategy given the clipped updates, as in a job spec
    max_norm: float = Field(1.0, gt=0, allow_inf_nan=False)  # C: the largest update norm let through

    @field_validator("inner")
    @classmethod
    def _inner_options(cls, inner: StrategySpec) -> StrategySpec:
        try:
            strategy_options(inner.name, inner.options)
        except CodeNotAllowed:
            raise  # not an option's mistake: the services refuse it (and count it) as such
        except ConfigError as exc:
            message = f"inner {exc}".replace("strategy.options.", "strategy.options.inner.options.")
            raise ValueError(message) from None
        return inner


class Clipped(Strategy):
    Options = ClippedOptions
    options: ClippedOptions

    def __init__(self, options: ClippedOptions | None = None) -> None:
        super().__init__(options)
        self.inner = make_strategy(self.options.inner)
        # The aggregator asks the strategy it holds, so the wrapper answers for the inner one.
        self.sends_client_state = self.inner.sends_client_state  # type: ignore[misc]
        self.expected_extras = self.inner.expected_extras  # type: ignore[misc]

    @classmethod
    def check_job(cls, options: StrategyOptions, job: JobFacts) -> None:
        inner = cast(ClippedOptions, options).inner
        strategy_class(inner.name).check_job(strategy_options(inner.name, inner.options), job)

    def configure(self, ctx: RoundContext) -> Config:
        return self.inner.configure(ctx)

    def aggregate(
        self,
        ctx: RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[ClientResult],
        failures: Sequence[ClientFailed],
    ) -> Aggregate:
        bound = self.options.max_norm
        norms = [delta_norm(r.load(), current) for r in results]
        clipped = [
            dataclasses.replace(r, loader=_clipping_loader(r, current, bound / norm))
            if norm > bound else r
            for r, norm in zip(results, norms, strict=True)
        ]
        out = self.inner.aggregate(ctx, current, clipped, failures)
        metrics = {
            **out.metrics,
            "clip_clients_clipped": float(sum(norm > bound for norm in norms)),
            "clip_norm_mean": math.fsum(norms) / len(norms) if norms else 0.0,
            "clip_norm_max": max(norms, default=0.0),
        }
        return dataclasses.replace(out, metrics=metrics)

    def state(self) -> StateDict:
        return self.inner.state()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.inner.load_state(state)


def _clipping_loader(
    result: ClientResult, current: Mapping[str, torch.Tensor], scale: float
) -> Callable[[], Mapping[str, torch.Tensor]]:
    """A ClientResult loader giving the client's weights with its delta scaled by `scale`."""
    return lambda: ClippedWeights(result.load(), current, scale)
