"""Byzantine-robust strategies: coordinate-wise median, trimmed mean, Krum, Multi-Krum and Bulyan.

Each combines the round's k client WEIGHTS with a robust kernel of kernels/robust.py:

    results ─▶ [r.load() for r in results]   k lazy maps (a tensor is read from the spooled
                                              update file only when looked up)
            ─▶ kernel, tensor by tensor       RAM: one model + k × the largest tensor slice
            ─▶ Aggregate(weights, {"selected": …, "dropped": …})

Weights, not deltas (w_i − w_global): every rule here commutes with a translation of all
k inputs, rule(w_g + d_i) = w_g + rule(d_i) (median, trimmed mean and the mean of a
selection move with the inputs; the squared distances Krum and Bulyan rank by do not
change at all), so both give the same model up to float rounding. Weights can go to the
kernel straight from the files; deltas would need a lazy subtraction layer for nothing.

The clients count equally, as in the papers: a robust rule must not let a client's own
claim of its example count decide its influence. Metrics (source "strategy"): `selected`,
the clients whose values the rule combined (all k for median and trimmed mean, which pick
per coordinate), and for Krum and Bulyan `dropped`, those it left out. Which clients were
dropped is not reported: client ids as metric labels would be unbounded.

A job whose rounds may close with too few clients for f (clients.min_fit below Krum's 2f + 3
or Bulyan's 4f + 3), or with fewer than Multi-Krum's m, is refused before it is published
(`check_job`); a round that still gets too few fails the job with an AggregationError.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar, cast

import torch
from pydantic import Field

from fedmq.common.strategy.contract import (
    Aggregate,
    ClientFailed,
    ClientResult,
    JobFacts,
    RoundContext,
    StateDict,
    Strategy,
    StrategyOptions,
)
from fedmq.services.aggregator.kernels import robust
from fedmq.services.aggregator.strategies.options import BuiltinOptions

Updates = Sequence[Mapping[str, torch.Tensor]]


class RobustStrategy(Strategy):
    """Base of the robust rules: the kernel over the lazily read weights, and the selection metrics."""

    reports_dropped = False  # Krum and Bulyan leave whole clients out; say how many

    def aggregate(
        self,
        ctx: RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[ClientResult],
        failures: Sequence[ClientFailed],
    ) -> Aggregate:
        updates = [r.load() for r in results]  # lazy: nothing is read yet
        weights, selected = self.combine(updates)
        metrics = {"selected": float(selected)}
        if self.reports_dropped:
            metrics["dropped"] = float(len(results) - selected)
        return Aggregate(weights, metrics)

    @abstractmethod
    def combine(self, updates: Updates) -> tuple[StateDict, int]:
        """The new weights from the k updates, and how many clients' values went into them."""


class Median(RobustStrategy):
    """Coordinate-wise median (Yin et al. 2018): w[j] = median_i w_i[j] (even k: mean of the middle two)."""

    def combine(self, updates: Updates) -> tuple[StateDict, int]:
        return robust.coordinate_median(updates), len(updates)


class TrimmedMean(RobustStrategy):
    """Coordinate-wise trimmed mean (Yin et al. 2018): per coordinate drop the b = floor(beta·k)
    largest and b smallest values and average the k − 2b left, w[j] = 1/(k−2b) · Σ_{i=b+1}^{k−b} w_(i)[j].
    """

    class Options(BuiltinOptions):
        beta: float = Field(0.2, ge=0, lt=0.5)  # the fraction trimmed from each end

    options: Options

    @classmethod
    def check_job(cls, options: StrategyOptions, job: JobFacts) -> None:
        beta = cast(TrimmedMean.Options, options).beta
        if beta > 0 and math.floor(beta * job.min_fit) == 0:
            raise ValueError(
                f"trimmed_mean with beta={beta} trims nothing from a round of clients.min_fit="
                f"{job.min_fit} clients (floor(beta·k) = 0): such a round is a plain mean; raise beta to "
                f"at least {1 / job.min_fit:.3g} or clients.min_fit to {math.ceil(1 / beta)}"
            )

    def combine(self, updates: Updates) -> tuple[StateDict, int]:
        return robust.trimmed_mean(updates, self.options.beta), len(updates)


class Krum(RobustStrategy):
    """Krum (Blanchard et al. 2017): the update with the lowest score s(i) = Σ_{j ∈ N(i)} ‖w_i − w_j‖²,
    N(i) its k − f − 2 nearest others; tolerates f Byzantine clients among k > 2f + 2.
    """

    class Options(BuiltinOptions):
        f: int = Field(1, ge=0)  # Byzantine clients tolerated

    options: Options
    reports_dropped = True
    label: ClassVar[str] = "krum"  # its name in a job spec, for messages

    @classmethod
    def check_job(cls, options: StrategyOptions, job: JobFacts) -> None:
        f = cast(Krum.Options, options).f
        need_at_least(job, 2 * f + 3, f"{cls.label} with f={f} (k > 2f + 2)")

    def keep(self, k: int) -> int:
        """m, how many of the best-scored updates are averaged: one for Krum."""
        return 1

    def combine(self, updates: Updates) -> tuple[StateDict, int]:
        weights, selected = robust.krum(updates, self.options.f, self.keep(len(updates)))
        return weights, len(selected)


class MultiKrum(Krum):
    """Multi-Krum (Blanchard et al. 2017): the mean of the m updates with the lowest Krum scores;
    m = k − f unless given (m = 1 is Krum, m = k is the plain mean).
    """

    class Options(Krum.Options):
        m: int | None = Field(None, ge=1)  # updates averaged; None: k − f

    options: Options
    label = "multi_krum"

    @classmethod
    def check_job(cls, options: StrategyOptions, job: JobFacts) -> None:
        super().check_job(options, job)
        m = cast(MultiKrum.Options, options).m
        if m is not None:
            need_at_least(job, m, f"multi_krum averaging m={m} updates")

    def keep(self, k: int) -> int:
        return self.options.m if self.options.m is not None else k - self.options.f


class Bulyan(RobustStrategy):
    """Bulyan (El Mhamdi et al. 2018) over Krum: needs k ≥ 4f + 3. Picks θ = k − 2f updates by Krum
    applied again and again to those left, then per coordinate averages the β = θ − 2f picked values
    closest to their median: w[j] = 1/β · Σ_{i ∈ M_j} w_i[j], M_j = argmin_{|M|=β} Σ_{i∈M} |w_i[j] − med_j|.
    """

    class Options(BuiltinOptions):
        f: int = Field(1, ge=0)  # Byzantine clients tolerated

    options: Options
    reports_dropped = True

    @classmethod
    def check_job(cls, options: StrategyOptions, job: JobFacts) -> None:
        f = cast(Bulyan.Options, options).f
        need_at_least(job, 4 * f + 3, f"bulyan with f={f} (k >= 4f + 3)")

    def combine(self, updates: Updates) -> tuple[StateDict, int]:
        weights, selected = robust.bulyan(updates, self.options.f)
        return weights, len(selected)


def need_at_least(job: JobFacts, clients: int, rule: str) -> None:
    """ValueError unless every round that may close (clients.min_fit of them or more) has `clients`."""
    if job.clients_per_round < clients:
        raise ValueError(
            f"{rule} needs {clients} clients a round; the job samples {job.clients_per_round} "
            f"(clients.per_round): lower the option or raise clients.per_round and clients.min_fit"
        )
    if job.min_fit < clients:
        raise ValueError(
            f"{rule} needs {clients} clients a round; a round may close with clients.min_fit="
            f"{job.min_fit}: set clients.min_fit >= {clients} or lower the option"
        )
