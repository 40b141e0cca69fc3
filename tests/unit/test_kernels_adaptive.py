"""FedOpt server steps checked against a NumPy transcription of Reddi et al. 2021, Algorithm 2."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmq.common.errors import AggregationError
from fedmq.services.aggregator.kernels.adaptive import Variant, fedopt_step
from fedmq.services.aggregator.kernels.mean import StateDict

VARIANTS: tuple[Variant, ...] = ("adagrad", "adam", "yogi")


def paper_fedopt(
    x0: np.ndarray,
    client_weights: Sequence[Sequence[np.ndarray]],
    variant: str,
    eta: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Algorithm 2 in float64: each round's Δ is the mean client delta; v₋₁ = τ², m₋₁ = 0."""
    x = x0.astype(np.float64)
    m = np.zeros_like(x)
    v = np.full_like(x, tau**2)
    for round_clients in client_weights:
        deltas = [np.asarray(c, dtype=np.float64) - x for c in round_clients]
        delta = np.mean(deltas, axis=0)
        m = beta1 * m + (1 - beta1) * delta
        if variant == "adagrad":
            v = v + delta**2
        elif variant == "adam":
            v = beta2 * v + (1 - beta2) * delta**2
        else:
            v = v - (1 - beta2) * delta**2 * np.sign(v - delta**2)
        x = x + eta * m / (np.sqrt(v) + tau)
    return x, m, v


def run_kernel(
    x0: torch.Tensor, client_weights: Sequence[Sequence[torch.Tensor]], variant: Variant, **hp: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel over several rounds; the averaged weights are a plain mean of the round's clients."""
    weights = {"w": x0}
    m = v = None
    for round_clients in client_weights:
        averaged = {"w": torch.stack([c.to(torch.float64) for c in round_clients]).mean(0).to(x0.dtype)}
        weights, m, v = fedopt_step(weights, averaged, m, v, variant=variant, **hp)
    assert m is not None and v is not None
    return weights["w"], m["w"], v["w"]


@settings(max_examples=40, deadline=None)
@given(
    variant=st.sampled_from(VARIANTS),
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple),
    clients=st.integers(1, 5),
    rounds=st.integers(1, 5),
    eta=st.floats(1e-3, 1.0),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.0, 0.999),
    tau=st.sampled_from([1e-9, 1e-6, 1e-3, 0.1, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_fedopt_matches_the_papers_algorithm_over_several_rounds_in_float64(
    variant: Variant,
    shape: tuple[int, ...],
    clients: int,
    rounds: int,
    eta: float,
    beta1: float,
    beta2: float,
    tau: float,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    x0 = np.asarray(rng.normal(size=shape))
    rounds_np = [
        [np.asarray(x0 + rng.normal(scale=0.5, size=shape)) for _ in range(clients)] for _ in range(rounds)
    ]
    hp = {"eta": eta, "beta1": beta1, "beta2": beta2, "tau": tau}
    want_x, want_m, want_v = paper_fedopt(x0, rounds_np, variant, **hp)
    got_x, got_m, got_v = run_kernel(
        torch.from_numpy(x0), [[torch.from_numpy(c) for c in r] for r in rounds_np], variant, **hp
    )
    assert got_x.dtype == got_m.dtype == got_v.dtype == torch.float64
    np.testing.assert_allclose(got_m.numpy(), want_m, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got_v.numpy(), want_v, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(got_x.numpy(), want_x, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fedopt_in_float32_matches_the_float64_oracle_to_float32_precision(variant: Variant) -> None:
    rng = np.random.default_rng(3)
    x0 = rng.normal(size=(64,)).astype(np.float32)
    rounds_np = [
        [(x0 + rng.normal(scale=0.1, size=64)).astype(np.float32) for _ in range(3)] for _ in range(4)
    ]
    hp = {"eta": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    # The oracle sees what the kernel sees: float32 weights and float32 means each round.
    want_x, _, _ = paper_fedopt(x0, rounds_np, variant, **hp)
    got_x, got_m, got_v = run_kernel(
        torch.from_numpy(x0), [[torch.from_numpy(c) for c in r] for r in rounds_np], variant, **hp
    )
    assert got_x.dtype == got_m.dtype == got_v.dtype == torch.float32
    np.testing.assert_allclose(got_x.numpy(), want_x, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_client_first_step_moves_each_coordinate_by_the_closed_form_amount(variant: Variant) -> None:
    # From m = 0, v = τ²: m = (1−β₁)Δ, and v is τ² + Δ², β₂τ² + (1−β₂)Δ² or τ² + (1−β₂)Δ² (Δ² > τ²).
    eta, beta1, beta2, tau = 0.5, 0.9, 0.99, 1e-3
    current = {"w": torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64)}
    client = {"w": torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64)}
    delta = np.array([1.0, -0.5, 0.0])
    v_want = {
        "adagrad": tau**2 + delta**2,
        "adam": beta2 * tau**2 + (1 - beta2) * delta**2,
        "yogi": tau**2 - (1 - beta2) * delta**2 * np.sign(tau**2 - delta**2),
    }[variant]
    weights, m, v = fedopt_step(
        current, client, None, None, variant=variant, eta=eta, beta1=beta1, beta2=beta2, tau=tau
    )
    np.testing.assert_allclose(m["w"].numpy(), (1 - beta1) * delta, rtol=1e-12)
    np.testing.assert_allclose(v["w"].numpy(), v_want, rtol=1e-12)
    want = current["w"].numpy() + eta * (1 - beta1) * delta / (np.sqrt(v_want) + tau)
    np.testing.assert_allclose(weights["w"].numpy(), want, rtol=1e-12)
    assert weights["w"][2].item() == -2.0  # a coordinate no client moved stays put


@pytest.mark.parametrize("variant", VARIANTS)
def test_equal_updates_that_match_the_model_leave_it_unchanged_from_a_fresh_start(variant: Variant) -> None:
    current = {"w": torch.randn(5, generator=torch.Generator().manual_seed(0))}
    weights, m, v = fedopt_step(
        current, dict(current), None, None, variant=variant, eta=1.0, beta1=0.9, beta2=0.99, tau=1e-6
    )
    assert torch.equal(weights["w"], current["w"])
    assert torch.equal(m["w"], torch.zeros(5))
    assert torch.all(v["w"] > 0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_tau_whose_square_underflows_still_gives_finite_weights(variant: Variant) -> None:
    # τ² = 1e-60 is 0 in float32: v starts at 0 and coordinates with Δ = 0 give 0 / (0 + τ) = 0, not NaN.
    current = {"w": torch.tensor([1.0, 2.0])}
    averaged = {"w": torch.tensor([1.0, 3.0])}
    weights, _, v = fedopt_step(
        current, averaged, None, None, variant=variant, eta=0.1, beta1=0.0, beta2=0.5, tau=1e-30
    )
    assert v["w"][0].item() == 0.0
    assert torch.isfinite(weights["w"]).all()
    assert weights["w"][0].item() == 1.0
    assert weights["w"][1].item() > 2.0


def test_yogi_shrinks_v_only_as_far_as_the_new_square_when_v_is_larger() -> None:
    # sign(v − Δ²) = +1: v ← v − (1−β₂)Δ²; equal: v unchanged; smaller: v grows.
    current = {"w": torch.zeros(3, dtype=torch.float64)}
    averaged = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}
    m0 = {"w": torch.zeros(3, dtype=torch.float64)}
    v0 = {"w": torch.tensor([5.0, 4.0, 1.0], dtype=torch.float64)}
    _, _, v = fedopt_step(current, averaged, m0, v0, variant="yogi", eta=0.1, beta1=0.9, beta2=0.75, tau=1e-3)
    assert v["w"].tolist() == [5.0 - 0.25 * 1.0, 4.0, 1.0 + 0.25 * 9.0]


def test_half_precision_weights_keep_their_dtype_and_float32_moments() -> None:
    current = {"w": torch.tensor([1.0, -1.0], dtype=torch.bfloat16), "h": torch.ones(2, dtype=torch.half)}
    averaged = {"w": torch.tensor([1.5, -1.5], dtype=torch.bfloat16), "h": torch.zeros(2, dtype=torch.half)}
    weights, m, v = fedopt_step(
        current, averaged, None, None, variant="adam", eta=0.1, beta1=0.9, beta2=0.99, tau=1e-3
    )
    assert weights["w"].dtype == torch.bfloat16 and weights["h"].dtype == torch.float16
    assert m["w"].dtype == v["w"].dtype == m["h"].dtype == torch.float32


def test_integer_tensors_take_the_averaged_value_and_have_no_moments() -> None:
    current = {"w": torch.zeros(2), "num_batches_tracked": torch.tensor(10)}
    averaged = {"w": torch.ones(2), "num_batches_tracked": torch.tensor(14)}
    weights, m, v = fedopt_step(
        current, averaged, None, None, variant="adagrad", eta=0.1, beta1=0.0, beta2=0.0, tau=1e-3
    )
    assert weights["num_batches_tracked"].item() == 14
    assert weights["num_batches_tracked"].dtype == torch.int64
    assert set(m) == set(v) == {"w"}


def test_the_inputs_are_never_modified() -> None:
    current = {"w": torch.zeros(4, dtype=torch.float64)}
    averaged = {"w": torch.ones(4, dtype=torch.float64)}
    m0 = {"w": torch.full((4,), 0.5, dtype=torch.float64)}
    v0 = {"w": torch.full((4,), 2.0, dtype=torch.float64)}
    copies = [{k: t.clone() for k, t in d.items()} for d in (current, averaged, m0, v0)]
    fedopt_step(current, averaged, m0, v0, variant="yogi", eta=1.0, beta1=0.9, beta2=0.99, tau=1e-3)
    for original, copy in zip((current, averaged, m0, v0), copies, strict=True):
        assert torch.equal(original["w"], copy["w"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_same_inputs_give_bit_identical_outputs(variant: Variant) -> None:
    g = torch.Generator().manual_seed(7)
    current = {"a": torch.randn(100, 30, generator=g), "b": torch.randn(7, generator=g)}
    averaged = {k: t + 0.01 * torch.randn(t.shape, generator=g) for k, t in current.items()}
    runs = [
        fedopt_step(current, averaged, None, None, variant=variant, eta=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
        for _ in range(2)
    ]
    for first, second in zip(runs[0], runs[1], strict=True):
        assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"variant": "adamw"}, "unknown FedOpt variant"),
        ({"eta": 0.0}, "eta must be"),
        ({"beta1": 1.0}, "beta1 must be in"),
        ({"beta2": -0.1}, "beta2 must be in"),
        ({"tau": 0.0}, "tau must be"),
        ({"tau": float("nan")}, "tau must be"),
    ],
)
def test_bad_hyperparameters_are_refused_with_the_rule(changes: dict, message: str) -> None:
    hp = {"variant": "adam", "eta": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3} | changes
    with pytest.raises(AggregationError, match=message):
        fedopt_step({"w": torch.zeros(1)}, {"w": torch.ones(1)}, None, None, **hp)


def test_a_server_state_that_does_not_match_the_model_is_refused() -> None:
    current = {"w": torch.zeros(2)}
    averaged = {"w": torch.ones(2)}

    def step(averaged: StateDict, m: StateDict | None, v: StateDict | None) -> None:
        fedopt_step(current, averaged, m, v, variant="adam", eta=0.1, beta1=0.9, beta2=0.99, tau=1e-3)

    with pytest.raises(AggregationError, match="both given or both None"):
        step(averaged, {"w": torch.zeros(2)}, None)
    with pytest.raises(AggregationError, match="no tensor 'w'"):
        step(averaged, {}, {})
    with pytest.raises(AggregationError, match="has shape"):
        step(averaged, {"w": torch.zeros(3)}, {"w": torch.zeros(2)})
    with pytest.raises(AggregationError, match="disagree on tensor names"):
        step({"x": torch.ones(2)}, None, None)
    with pytest.raises(AggregationError, match="averaged shape"):
        step({"w": torch.ones(3)}, None, None)
