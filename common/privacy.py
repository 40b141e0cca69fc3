"""Privacy accounting: the (epsilon, delta) spent after some releases of the sampled Gaussian mechanism.

Two mechanisms are accounted, each release one composition (`rounds` below counts them):
- DP-FedAvg (the `dp` strategy): a round, with clients sampled at rate q = clients per round /
  total clients and noise multiplier z (with adaptive clipping, the job's z, not the update's z_Δ:
  Andrew et al.'s Theorem 1 makes the pair cost exactly one mechanism with z).
- Local DP-SGD (`train.dp_sgd`, common/task/dpsgd.py): one optimizer step on one client, examples
  sampled at rate q = batch size / the client's examples.
The accountant is Opacus's Rényi-DP analysis (Mironov 2017; Mironov, Talwar and Zhang 2019), with
Balle et al. 2020's RDP-to-(ε, δ) conversion over Opacus's default orders.

Why Opacus rather than Google's dp-accounting: both carry the same RDP analysis (ported from
TensorFlow Privacy), but dp-accounting 0.6 pins attrs < 24 (fedmq's test tools need a newer one)
and pulls dm-tree and absl, while Opacus needs only torch, which fedmq already has. It is imported
on first use: services that never account pay nothing.

The analysis assumes Poisson sampling; fedmq samples a fixed number of clients per round and
shuffles examples into fixed-size batches, the usual approximation (McMahan et al. 2018 and
Abadi et al. 2016 do the same).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from fedmq.common.errors import ConfigError


def _check(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> None:
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ConfigError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}")
    if not 0 < sampling_rate <= 1:
        raise ConfigError(f"sampling_rate must be in (0, 1] (clients per round / total), got {sampling_rate}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ConfigError(f"rounds must be a whole number >= 0, got {rounds!r}")
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), usually below 1/total clients; got {delta}")


def epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """ε after `rounds` rounds at the given δ; 0 before any round, inf when z = 0 (no noise)."""
    _check(noise_multiplier, sampling_rate, rounds, delta)
    if rounds == 0:
        return 0.0
    from opacus.accountants.analysis import rdp

    orders, one_round = _rdp_of_one_round(noise_multiplier, sampling_rate)
    with warnings.catch_warnings():
        # "Optimal order is the smallest/largest alpha": the bound is still valid, only looser.
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = rdp.get_privacy_spent(orders=orders, rdp=one_round * rounds, delta=delta)
    return float(eps)


# ~0.25 s a miss here. DP-SGD asks once per client and round, each client at its own sampling
# rate (batch size / its examples): the cache holds many rates (a few KiB each), so a round of
# hundreds of clients does not compute them all again every round.
@functools.lru_cache(maxsize=8192)
def _rdp_of_one_round(noise_multiplier: float, sampling_rate: float) -> tuple[list[float], Any]:
    """Opacus's default orders and the RDP of one round at each (the slow part: series per order).

    T rounds cost T times as much; Opacus's own compute_rdp(steps=T) multiplies the same way.
    """
    from opacus.accountants.analysis import rdp
    from opacus.accountants.rdp import RDPAccountant

    orders = list(RDPAccountant.DEFAULT_ALPHAS)
    one_round = rdp.compute_rdp(q=sampling_rate, noise_multiplier=noise_multiplier, steps=1, orders=orders)
    one_round.setflags(write=False)
    return orders, one_round


@dataclass
class PrivacyAccountant:
    """Rounds spent at fixed parameters. Its state is its fields: persist `state()`, restore `from_state`."""

    noise_multiplier: float
    sampling_rate: float
    delta: float
    rounds: int = 0

    def __post_init__(self) -> None:
        _check(self.noise_multiplier, self.sampling_rate, self.rounds, self.delta)

    def step(self, rounds: int = 1) -> None:
        """Count `rounds` more releases."""
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ConfigError(f"rounds must be a whole number >= 0, got {rounds!r}")
        self.rounds += rounds

    def epsilon(self) -> float:
        return epsilon(self.noise_multiplier, self.sampling_rate, self.rounds, self.delta)

    def state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PrivacyAccountant:
        fields = {"noise_multiplier", "sampling_rate", "delta", "rounds"}
        if set(state) != fields:
            raise ConfigError(f"privacy accountant state needs exactly {sorted(fields)}, got {sorted(state)}")
        return cls(**state)
