"""DP-FedAvg with fixed clipping (McMahan et al. 2018) and with adaptive clipping (Andrew et al. 2021).

Each round, over the m clients aggregated (uniform weights, not examples: the sensitivity is C/m):

    Δₖ = wₖ − w,   Δₖ ← Δₖ·min(1, C/‖Δₖ‖)                 clip each client's update to norm C
    w ← w + (1/m)·Σ Δₖ + N(0, (z·C/m)²)                    Gaussian noise, multiplier z
    adaptive:  b̄ = (Σ 1[‖Δₖ‖ ≤ C] + N(0, σ_b²)) / m,   C ← C·exp(−η_C·(b̄ − γ))

With adaptive clipping the update's multiplier is z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), so the pair of
releases costs one mechanism with multiplier z (Andrew et al., Theorem 1). The maths is
kernels.private; noise is drawn only from `ctx.generator("dp")`, so runs are reproducible.

Privacy: every round the strategy reports `epsilon`, the ε spent so far at the job's `delta`
(Opacus's RDP accountant, common/privacy.py), for multiplier z and sampling rate
q = clients sampled per round / total clients (the round's results plus its failures: fedmq
samples `clients.per_round`). With z = 0 there is no privacy and no `epsilon`. The rounds spent,
q and the adaptive bound persist in `state()`, so a restarted aggregator reports the same ε.
Metrics by default are only what the private release allows: `epsilon`, the bound applied
(`dp_clip_norm`, and `dp_clip_norm_next`, computed from the noised count), the multiplier and the
clients aggregated. The clients' raw clipping statistics (`dp_clipped`, `dp_norm_mean`,
`dp_norm_max`) are NOT covered by epsilon: in adaptive mode `dp_clipped` is exactly the count the
algorithm noises. They are reported only with `report_client_stats: true`, for tuning on data
that needs no privacy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from pydantic import Field, model_validator

from fedmq.common.errors import AggregationError
from fedmq.common.privacy import epsilon
from fedmq.common.strategy.contract import (
    Aggregate,
    ClientFailed,
    ClientResult,
    RoundContext,
    StateDict,
    Strategy,
)
from fedmq.services.aggregator.kernels.private import ClipReport, adaptive_dp_fedavg, dp_fedavg
from fedmq.services.aggregator.strategies.options import BuiltinOptions

ROUNDS = "dp.rounds"  # int64 scalar: rounds accounted
SAMPLING_RATE = "dp.sampling_rate"  # float64 scalar: q, once a round has been accounted
CLIP_NORM = "dp.clip_norm"  # float64 scalar: adaptive clipping's bound for the next round
CLIENT_STATS = frozenset({"dp_clipped", "dp_norm_mean", "dp_norm_max"})  # raw, outside epsilon


class DPFedAvgOptions(BuiltinOptions):
    clip_norm: float = Field(1.0, gt=0, allow_inf_nan=False)  # C: each client's update norm bound
    noise_multiplier: float = Field(1.0, ge=0, allow_inf_nan=False)  # z: noise std is z·C/m
    delta: float = Field(1e-5, gt=0, lt=1)  # the δ that `epsilon` is reported at
    report_client_stats: bool = False  # raw clipped count and norms: outside epsilon, for tuning only


class DPFedAvg(Strategy):
    Options = DPFedAvgOptions
    options: DPFedAvgOptions

    def __init__(self, options: DPFedAvgOptions | None = None) -> None:
        super().__init__(options)
        self._rounds = 0
        self._sampling_rate: float | None = None

    def aggregate(
        self,
        ctx: RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[ClientResult],
        failures: Sequence[ClientFailed],
    ) -> Aggregate:
        sampling_rate = self._account(ctx, results, failures)
        weights, report = self.private_mean(ctx, current, results)
        self._rounds += 1
        metrics = report.metrics()
        if not self.options.report_client_stats:
            metrics = {k: v for k, v in metrics.items() if k not in CLIENT_STATS}
        if self.options.noise_multiplier > 0:
            options = self.options
            metrics["epsilon"] = epsilon(options.noise_multiplier, sampling_rate, self._rounds, options.delta)
        return Aggregate(weights, metrics=metrics)

    def private_mean(
        self, ctx: RoundContext, current: Mapping[str, torch.Tensor], results: Sequence[ClientResult]
    ) -> tuple[StateDict, ClipReport]:
        """The clipped, noised mean of the round's updates and what clipping did."""
        return dp_fedavg(
            current, (r.load() for r in results), clip_norm=self.options.clip_norm,
            noise_multiplier=self.options.noise_multiplier, generator=ctx.generator("dp"),
        )

    def _account(
        self, ctx: RoundContext, results: Sequence[ClientResult], failures: Sequence[ClientFailed]
    ) -> float:
        """q of this round; the same every round (fedmq samples `clients.per_round` each time)."""
        sampling_rate = (len(results) + len(failures)) / ctx.num_clients
        if self._sampling_rate is not None and sampling_rate != self._sampling_rate:
            raise AggregationError(
                f"round {ctx.round} sampled a fraction {sampling_rate} of the clients, earlier rounds "
                f"{self._sampling_rate}: the privacy accountant needs one sampling rate"
            )
        self._sampling_rate = sampling_rate
        return sampling_rate

    def state(self) -> StateDict:
        state = {ROUNDS: torch.tensor(self._rounds, dtype=torch.int64)}
        if self._sampling_rate is not None:
            state[SAMPLING_RATE] = torch.tensor(self._sampling_rate, dtype=torch.float64)
        return state

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self._rounds = int(state[ROUNDS].item()) if ROUNDS in state else 0
        self._sampling_rate = float(state[SAMPLING_RATE].item()) if SAMPLING_RATE in state else None


class AdaptiveDPFedAvgOptions(DPFedAvgOptions):
    clip_norm: float = Field(0.1, gt=0, allow_inf_nan=False)  # C₀: the first round's bound
    target_quantile: float = Field(0.5, ge=0, le=1)  # γ: the fraction of clients left unclipped
    clip_learning_rate: float = Field(0.2, ge=0, allow_inf_nan=False)  # η_C
    count_noise_std: float = Field(1.0, ge=0, allow_inf_nan=False)  # σ_b: noise on the unclipped count

    @model_validator(mode="after")
    def _count_noise(self) -> AdaptiveDPFedAvgOptions:
        if self.noise_multiplier > 0 and 2 * self.count_noise_std <= self.noise_multiplier:
            raise ValueError(
                f"count_noise_std must exceed noise_multiplier/2 = {self.noise_multiplier / 2} "
                "(Andrew et al. suggest about clients per round / 20)"
            )
        return self


class AdaptiveDPFedAvg(DPFedAvg):
    Options = AdaptiveDPFedAvgOptions
    options: AdaptiveDPFedAvgOptions

    def __init__(self, options: AdaptiveDPFedAvgOptions | None = None) -> None:
        super().__init__(options)
        self._clip_norm = self.options.clip_norm

    def private_mean(
        self, ctx: RoundContext, current: Mapping[str, torch.Tensor], results: Sequence[ClientResult]
    ) -> tuple[StateDict, ClipReport]:
        options = self.options
        weights, report = adaptive_dp_fedavg(
            current, (r.load() for r in results), clip_norm=self._clip_norm,
            noise_multiplier=options.noise_multiplier, count_noise_std=options.count_noise_std,
            target_quantile=options.target_quantile, clip_learning_rate=options.clip_learning_rate,
            generator=ctx.generator("dp"),
        )
        if report.next_clip_norm is not None:  # always set by adaptive_dp_fedavg
            self._clip_norm = report.next_clip_norm
        return weights, report

    def state(self) -> StateDict:
        return {**super().state(), CLIP_NORM: torch.tensor(self._clip_norm, dtype=torch.float64)}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        super().load_state(state)
        self._clip_norm = float(state[CLIP_NORM].item()) if CLIP_NORM in state else self.options.clip_norm
