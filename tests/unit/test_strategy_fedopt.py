"""FedAdagrad, FedAdam and FedYogi through the strategy: Reddi et al.'s Algorithm 2, state kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import StrategySpec
from fedmq.common.strategy.contract import ClientResult, RoundContext, StateDict
from fedmq.common.strategy.loading import make_strategy, strategy_options
from fedmq.services.aggregator.strategies.fedopt import FedOpt

NAMES = ("fedadagrad", "fedadam", "fedyogi")
HP = {"eta": 0.05, "beta1": 0.8, "tau": 1e-2}


def fedopt(name: str, **options: float) -> FedOpt:
    if name != "fedadagrad":
        options = {"beta2": 0.95, **options}
    strategy = make_strategy(StrategySpec(name=name, options={**HP, **options}))
    assert isinstance(strategy, FedOpt)
    return strategy


def paper(
    x0: np.ndarray, rounds: Sequence[Sequence[tuple[np.ndarray, int]]], name: str
) -> tuple[np.ndarray, list[float]]:
    """Algorithm 2 from the paper, with Δ = FedAvg's example-weighted mean minus x; and each ‖Δ‖."""
    eta, beta1, tau, beta2 = HP["eta"], HP["beta1"], HP["tau"], 0.95
    x, m, v = x0.copy(), np.zeros_like(x0), np.full_like(x0, tau**2)
    norms = []
    for clients in rounds:
        delta = np.average([w for w, _ in clients], axis=0, weights=[n for _, n in clients]) - x
        norms.append(float(np.linalg.norm(delta)))
        m = beta1 * m + (1 - beta1) * delta
        if name == "fedadagrad":
            v = v + delta**2
        elif name == "fedadam":
            v = beta2 * v + (1 - beta2) * delta**2
        else:
            v = v - (1 - beta2) * delta**2 * np.sign(v - delta**2)
        x = x + eta * m / (np.sqrt(v) + tau)
    return x, norms


def make_rounds(seed: int, count: int, clients: int = 3) -> list[list[tuple[np.ndarray, int]]]:
    rng = np.random.default_rng(seed)
    return [
        [(rng.normal(size=(4, 3)), int(rng.integers(1, 50))) for _ in range(clients)] for _ in range(count)
    ]


def result(client: int, num_examples: int, weights: Mapping[str, torch.Tensor],
           extras: Mapping[str, torch.Tensor] | None = None) -> ClientResult:
    return ClientResult(client=client, num_examples=num_examples, loader=lambda: weights,
                        extras_loader=lambda: extras or {})


def step(strategy: FedOpt, server_round: int, current: StateDict,
         clients: Sequence[tuple[np.ndarray, int]]) -> tuple[StateDict, dict[str, float]]:
    results = [result(i, n, {"w": torch.from_numpy(w), "count": torch.tensor(7)})
               for i, (w, n) in enumerate(clients)]
    ctx = RoundContext(round=server_round, rounds=10, seed=0, num_clients=len(clients))
    out = strategy.aggregate(ctx, current, results, [])
    return dict(out.weights), out.metrics


@pytest.mark.parametrize("name", NAMES)
def test_each_variant_follows_the_papers_algorithm_over_fedavgs_mean_for_several_rounds(name: str) -> None:
    rounds = make_rounds(seed=3, count=4)
    x0 = np.random.default_rng(4).normal(size=(4, 3))
    strategy = fedopt(name)
    weights: StateDict = {"w": torch.from_numpy(x0.copy()), "count": torch.tensor(0)}
    norms = []
    for r, clients in enumerate(rounds, start=1):
        weights, metrics = step(strategy, r, weights, clients)
        norms.append(metrics["pseudo_gradient_norm"])
    expected, expected_norms = paper(x0, rounds, name)
    np.testing.assert_allclose(weights["w"].numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-12)
    assert weights["count"].item() == 7, "an integer buffer takes the clients' mean"


@pytest.mark.parametrize("name", NAMES)
def test_a_strategy_restored_from_its_state_takes_the_same_steps_bit_for_bit(name: str) -> None:
    rounds = make_rounds(seed=5, count=4)
    start: StateDict = {"w": torch.zeros(4, 3, dtype=torch.float64), "count": torch.tensor(0)}
    undisturbed, weights = fedopt(name), start
    for r, clients in enumerate(rounds, start=1):
        weights, _ = step(undisturbed, r, weights, clients)
    first, resumed = fedopt(name), start
    for r, clients in enumerate(rounds[:2], start=1):
        resumed, _ = step(first, r, resumed, clients)
    state = {k: v.clone() for k, v in first.state().items()}
    assert sorted(state) == ["m.w", "v.w"], "moments of floating tensors only"
    restarted = fedopt(name)
    restarted.load_state(state)
    for r, clients in enumerate(rounds[2:], start=3):
        resumed, _ = step(restarted, r, resumed, clients)
    assert torch.equal(resumed["w"], weights["w"])
    fresh = fedopt(name)
    fresh.load_state({})
    assert fresh.state() == {}, "an empty state (round 0) starts from m = 0, v = τ²"


def test_without_restored_moments_the_steps_differ() -> None:
    """The restore test above can fail: a strategy that forgot m and v steps elsewhere."""
    rounds = make_rounds(seed=5, count=3)
    start: StateDict = {"w": torch.zeros(4, 3, dtype=torch.float64), "count": torch.tensor(0)}
    kept, forgetful, a, b = fedopt("fedadam"), fedopt("fedadam"), start, start
    for r, clients in enumerate(rounds, start=1):
        a, _ = step(kept, r, a, clients)
        forgetful.load_state({})
        b, _ = step(forgetful, r, b, clients)
    assert not torch.equal(a["w"], b["w"])


def test_the_server_step_norm_is_the_distance_moved() -> None:
    current: StateDict = {"w": torch.zeros(4, 3, dtype=torch.float64), "count": torch.tensor(0)}
    weights, metrics = step(fedopt("fedyogi"), 1, current, make_rounds(seed=1, count=1)[0])
    assert metrics["server_step_norm"] == pytest.approx(float(weights["w"].norm()), rel=1e-12)


def test_float32_weights_keep_their_dtype_and_float32_moments() -> None:
    strategy = fedopt("fedadam")
    clients = [(w.astype(np.float32), n) for w, n in make_rounds(seed=2, count=1)[0]]
    weights, _ = step(strategy, 1, {"w": torch.zeros(4, 3), "count": torch.tensor(0)}, clients)
    assert weights["w"].dtype == torch.float32
    assert {k: v.dtype for k, v in strategy.state().items()} == {"m.w": torch.float32, "v.w": torch.float32}


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("fedadagrad", {"beta2": 0.9}, "beta2: unknown option; did you mean 'beta1'?"),
        ("fedadam", {"eta": 0}, "eta: Input should be greater than 0"),
        ("fedyogi", {"tau": 0.0}, "tau: Input should be greater than 0"),
        ("fedadam", {"beta1": 1.0}, "beta1: Input should be less than 1"),
        ("fedyogi", {"beta2": -0.1}, "beta2: Input should be greater than or equal to 0"),
        ("fedadam", {"eta": float("nan")}, "eta: Input should be a finite number"),
    ],
)
def test_bad_options_are_refused_naming_the_option(name: str, options: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"strategy.options.{expected}"):
        strategy_options(name, options)
