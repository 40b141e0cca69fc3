"""The privacy accountant: Opacus's own RDP computation, the Gaussian formula, and its monotonicity."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmq.common.errors import ConfigError
from fedmq.common.privacy import PrivacyAccountant, epsilon


def opacus_epsilon(z: float, q: float, rounds: int, delta: float) -> float:
    """What a user of Opacus gets: one accountant step per round, then get_epsilon."""
    from opacus.accountants.rdp import RDPAccountant  # here: importing opacus takes 2.6 s

    accountant = RDPAccountant()
    for _ in range(rounds):
        accountant.step(noise_multiplier=z, sample_rate=q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(accountant.get_epsilon(delta=delta))


def gaussian_epsilon(z: float, rounds: int, delta: float) -> float:
    """q = 1, from the papers: RDP of the Gaussian mechanism is T·α/(2z²) (Mironov 2017, Prop. 7),
    converted with Balle et al. 2020, Thm 21: ε = rdp − (log δ + log α)/(α − 1) + log((α − 1)/α)."""
    alphas = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=np.float64)
    rdp = rounds * alphas / (2 * z**2)
    eps = rdp - (np.log(delta) + np.log(alphas)) / (alphas - 1) + np.log((alphas - 1) / alphas)
    return float(eps.min())


@pytest.mark.parametrize(
    ("z", "q", "rounds", "delta"),
    [
        (1.0, 0.1, 30, 1e-5),
        (0.5, 0.01, 1000, 1e-6),
        (4.0, 1.0, 5, 1e-3),
        (1.1, 0.05, 1, 1e-5),
        (0.3, 0.2, 7, 0.01),
    ],
)
def test_epsilon_equals_opacus_own_accountant_for_the_same_parameters(
    z: float, q: float, rounds: int, delta: float
) -> None:
    assert epsilon(z, q, rounds, delta) == opacus_epsilon(z, q, rounds, delta)


@settings(max_examples=30, deadline=None)
@given(z=st.floats(0.3, 20.0), rounds=st.integers(1, 500), delta=st.sampled_from([1e-3, 1e-5, 1e-8]))
def test_without_sampling_epsilon_is_the_gaussian_mechanisms_rdp_bound(
    z: float, rounds: int, delta: float
) -> None:
    assert epsilon(z, 1.0, rounds, delta) == pytest.approx(gaussian_epsilon(z, rounds, delta), rel=1e-12)


@settings(max_examples=12, deadline=None)
@given(z=st.floats(0.3, 20.0), q=st.floats(0.001, 0.9), rounds=st.integers(1, 200))
def test_sampling_fewer_clients_never_costs_more_privacy(z: float, q: float, rounds: int) -> None:
    assert epsilon(z, q, rounds, 1e-5) <= epsilon(z, 1.0, rounds, 1e-5)


@pytest.mark.parametrize(("z", "q"), [(0.7, 0.1), (1.0, 0.01), (3.0, 1.0)])
def test_epsilon_grows_with_every_round(z: float, q: float) -> None:
    spent = [epsilon(z, q, rounds, 1e-5) for rounds in (0, 1, 2, 3, 5, 8, 13, 50, 400)]
    assert spent[0] == 0.0
    assert all(b > a for a, b in zip(spent, spent[1:], strict=False))


@pytest.mark.parametrize(("q", "rounds"), [(0.1, 50), (0.01, 1000), (1.0, 3)])
def test_epsilon_falls_as_the_noise_multiplier_rises(q: float, rounds: int) -> None:
    spent = [epsilon(z, q, rounds, 1e-5) for z in np.linspace(0.4, 8.0, 25)]
    assert all(b < a for a, b in zip(spent, spent[1:], strict=False))


def test_no_noise_means_no_privacy() -> None:
    assert epsilon(0.0, 0.1, 1, 1e-5) == math.inf


def test_an_accountant_counts_rounds_and_resumes_from_its_state() -> None:
    accountant = PrivacyAccountant(noise_multiplier=1.1, sampling_rate=0.1, delta=1e-5)
    assert accountant.epsilon() == 0.0
    for _ in range(10):
        accountant.step()
    saved = accountant.state()
    assert saved == {"noise_multiplier": 1.1, "sampling_rate": 0.1, "delta": 1e-5, "rounds": 10}
    resumed = PrivacyAccountant.from_state(dict(saved))
    accountant.step(5)
    resumed.step(5)
    assert resumed.epsilon() == accountant.epsilon() == epsilon(1.1, 0.1, 15, 1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1.0, 0.1, 1, 1e-5), "noise_multiplier"),
        ((math.nan, 0.1, 1, 1e-5), "noise_multiplier"),
        ((1.0, 0.0, 1, 1e-5), "sampling_rate"),
        ((1.0, 1.5, 1, 1e-5), "sampling_rate"),
        ((1.0, 0.1, -1, 1e-5), "rounds"),
        ((1.0, 0.1, 2.5, 1e-5), "rounds"),
        ((1.0, 0.1, 1, 0.0), "delta"),
        ((1.0, 0.1, 1, 1.0), "delta"),
    ],
)
def test_bad_parameters_are_refused_with_the_allowed_range(args: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        epsilon(*args)
    with pytest.raises(ConfigError, match=message):
        PrivacyAccountant(noise_multiplier=args[0], sampling_rate=args[1], rounds=args[2], delta=args[3])


def test_a_damaged_state_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs exactly"):
        PrivacyAccountant.from_state({"noise_multiplier": 1.0, "sampling_rate": 0.1, "rounds": 3})
    with pytest.raises(ConfigError, match="rounds"):
        PrivacyAccountant(noise_multiplier=1.0, sampling_rate=0.1, delta=1e-5).step(-2)
