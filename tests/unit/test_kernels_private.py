"""DP-FedAvg kernels checked against NumPy transcriptions of McMahan et al. 2018 and Andrew et al. 2021."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmq.common.errors import AggregationError
from fedmq.services.aggregator.kernels.mean import StateDict
from fedmq.services.aggregator.kernels.private import (
    adaptive_dp_fedavg,
    clip_delta,
    delta_noise_multiplier,
    delta_norm,
    dp_fedavg,
    geometric_clip_update,
    global_norm,
    noisy_unclipped_fraction,
)

# Clipping scales in the tensor's dtype: the clipped norm may pass C by rounding, never by more.
ROUNDING = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def np64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


def paper_dp_fedavg_mean(
    current: Mapping[str, np.ndarray], clients: Sequence[Mapping[str, np.ndarray]], bound: float
) -> tuple[dict[str, np.ndarray], list[float]]:
    """Noiseless DP-FedAvg in float64: clip each Δₖ to L2 norm `bound` over all tensors, then average."""
    deltas = [{k: c[k] - current[k] for k in current} for c in clients]
    norms = [math.sqrt(sum(float(np.sum(d[k] ** 2)) for k in d)) for d in deltas]
    clipped = [
        {k: d[k] * min(1.0, bound / n) if n > 0 else d[k] for k in d}
        for d, n in zip(deltas, norms, strict=True)
    ]
    mean = {k: np.mean([c[k] for c in clipped], axis=0) for k in current}
    return {k: current[k] + mean[k] for k in current}, norms


def random_model(
    rng: np.random.Generator, shapes: Sequence[tuple[int, ...]], scale: float
) -> dict[str, np.ndarray]:
    return {f"t{i}": np.asarray(rng.normal(scale=scale, size=s)) for i, s in enumerate(shapes)}


def to_torch(model: Mapping[str, np.ndarray], dtype: torch.dtype) -> StateDict:
    return {k: torch.from_numpy(np.asarray(v)).to(dtype) for k, v in model.items()}


shapes_st = st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3)


# --- clipping ------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(list(ROUNDING)),
    shapes=shapes_st,
    scale=st.floats(1e-3, 1e3),
    bound=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_clipped_update_never_exceeds_the_bound_and_one_under_it_is_untouched(
    dtype: torch.dtype, shapes: list[tuple[int, ...]], scale: float, bound: float, seed: int
) -> None:
    delta = to_torch(random_model(np.random.default_rng(seed), shapes, scale), dtype)
    clipped, norm = clip_delta(delta, bound)
    assert norm == pytest.approx(
        math.sqrt(sum(float(np.sum(np64(t) ** 2)) for t in delta.values())), rel=1e-12
    )
    after = global_norm(clipped)
    assert after <= bound * (1 + ROUNDING[dtype])
    if norm <= bound:
        assert all(torch.equal(clipped[k], delta[k]) for k in delta)
    else:
        assert after == pytest.approx(bound, rel=ROUNDING[dtype] * 10)
    assert all(clipped[k].dtype == dtype for k in delta)


def test_clipping_ignores_integer_tensors_in_the_norm_and_leaves_them_alone() -> None:
    delta = {"w": torch.tensor([3.0, 4.0]), "count": torch.tensor([1000])}
    clipped, norm = clip_delta(delta, 1.0)
    assert norm == 5.0
    assert torch.allclose(clipped["w"], torch.tensor([0.6, 0.8]))
    assert clipped["count"].item() == 1000


def test_the_norm_of_a_large_float32_update_is_exact_to_float64_rounding() -> None:
    # A float32 reduction under-reads this norm by ~1e-4 (0.6% at 64M elements): clipping would leak.
    big = {"w": torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 3 + 1}
    want = math.sqrt(float(np.sum(np64(big["w"]) ** 2)))
    assert global_norm(big) == pytest.approx(want, rel=1e-12)


def test_norms_do_not_depend_on_the_thread_count() -> None:
    rng = np.random.default_rng(5)
    state = {name: torch.from_numpy(rng.standard_normal(n)) for name, n in [("w", 300_007), ("v", 70_001)]}
    other = {k: v + 1e-3 for k, v in state.items()}
    threads = torch.get_num_threads()
    try:
        seen = set()
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            seen.add((global_norm(state), delta_norm(other, state)))
    finally:
        torch.set_num_threads(threads)
    assert len(seen) == 1, seen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_delta_norm_is_the_numpy_norm_of_the_difference_over_floating_tensors(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    current = {"a": torch.randn(70_000, generator=g).to(dtype), "b": torch.randn(3, 4, generator=g).to(dtype),
               "steps": torch.tensor([5])}
    new = {"a": torch.randn(70_000, generator=g).to(dtype), "b": torch.randn(3, 4, generator=g).to(dtype),
           "steps": torch.tensor([900])}
    want = math.sqrt(sum(float(np.sum((np64(new[k]) - np64(current[k])) ** 2)) for k in ("a", "b")))
    assert delta_norm(new, current) == pytest.approx(want, rel=1e-12)
    assert delta_norm(current, current) == 0.0


def test_the_inputs_are_never_modified() -> None:
    g = torch.Generator().manual_seed(1)
    current = {"a": torch.randn(10, dtype=torch.float64, generator=g), "b": torch.randn(3, generator=g)}
    updates = [{k: t + 5 * torch.randn(t.shape, dtype=t.dtype, generator=g) for k, t in current.items()}]
    copies = [{k: t.clone() for k, t in d.items()} for d in (current, *updates)]
    dp_fedavg(current, updates, clip_norm=1.0, noise_multiplier=1.0, generator=g)
    clip_delta(updates[0], 1.0)
    for original, copy in zip((current, *updates), copies, strict=True):
        assert all(torch.equal(original[k], copy[k]) for k in original)


def test_a_zero_update_is_not_divided_by_its_zero_norm() -> None:
    clipped, norm = clip_delta({"w": torch.zeros(3)}, 1.0)
    assert norm == 0.0 and torch.equal(clipped["w"], torch.zeros(3))


# --- DP-FedAvg mean against the oracle --------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float64, torch.float32]),
    shapes=shapes_st,
    clients=st.integers(1, 6),
    bound=st.floats(0.05, 5.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_noiseless_dp_fedavg_matches_the_papers_clipped_uniform_mean(
    dtype: torch.dtype, shapes: list[tuple[int, ...]], clients: int, bound: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    current = random_model(rng, shapes, 1.0)
    # Client scales from far under to far over the bound, so both branches are taken.
    updates = [
        {k: current[k] + d for k, d in random_model(rng, shapes, float(rng.choice([0.01, 0.3, 3.0]))).items()}
        for _ in range(clients)
    ]
    current_t = to_torch(current, dtype)
    updates_t = [to_torch(u, dtype) for u in updates]
    # The oracle reads the same (possibly float32-rounded) numbers the kernel reads.
    want, norms = paper_dp_fedavg_mean(
        {k: np64(t) for k, t in current_t.items()},
        [{k: np64(t) for k, t in u.items()} for u in updates_t],
        bound,
    )
    got, report = dp_fedavg(
        current_t,
        updates_t,
        clip_norm=bound,
        noise_multiplier=0.0,
        generator=torch.Generator().manual_seed(0),
    )
    rtol, atol = (1e-12, 1e-12) if dtype == torch.float64 else (1e-5, 1e-5)
    for k in current:
        assert got[k].dtype == dtype
        np.testing.assert_allclose(np64(got[k]), want[k], rtol=rtol, atol=atol)
    assert report.clients == clients
    assert report.clipped == sum(1 for n in norms if n > bound)
    assert report.norm_max == pytest.approx(max(norms), rel=rtol)
    assert report.norm_mean == pytest.approx(float(np.mean(norms)), rel=rtol)
    assert report.clip_norm == bound


def test_one_client_moves_the_model_by_its_clipped_update() -> None:
    current = {"w": torch.zeros(2, dtype=torch.float64)}
    got, report = dp_fedavg(
        current,
        [{"w": torch.tensor([6.0, 8.0], dtype=torch.float64)}],
        clip_norm=5.0,
        noise_multiplier=0.0,
        generator=torch.Generator(),
    )
    assert got["w"].tolist() == [3.0, 4.0]
    assert (report.clients, report.clipped, report.norm_max, report.norm_mean) == (1, 1, 10.0, 10.0)


def test_an_update_exactly_at_the_bound_counts_as_unclipped_and_is_untouched() -> None:
    # Andrew et al.: bₖ = 1[‖Δₖ‖ ≤ C], so equality is on the unclipped side.
    current = {"w": torch.zeros(2, dtype=torch.float64)}
    update = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    got, report = dp_fedavg(
        current, [update], clip_norm=5.0, noise_multiplier=0.0, generator=torch.Generator()
    )
    assert torch.equal(got["w"], update["w"])
    assert (report.clipped, report.unclipped) == (0, 1)


def test_equal_updates_under_the_bound_average_to_themselves() -> None:
    current = {"w": torch.tensor([1.0, 1.0], dtype=torch.float64)}
    update = {"w": torch.tensor([1.5, 0.5], dtype=torch.float64)}
    got, report = dp_fedavg(
        current, [update] * 4, clip_norm=1.0, noise_multiplier=0.0, generator=torch.Generator()
    )
    assert torch.equal(got["w"], update["w"])
    assert report.clipped == 0 and report.unclipped == 4


def test_integer_tensors_keep_the_current_value_whatever_clients_send() -> None:
    current = {"w": torch.zeros(2), "num_batches_tracked": torch.tensor(5)}
    updates = [{"w": torch.ones(2), "num_batches_tracked": torch.tensor(99)}]
    got, _ = dp_fedavg(current, updates, clip_norm=10.0, noise_multiplier=1.0, generator=torch.Generator())
    assert got["num_batches_tracked"].item() == 5


# --- noise ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_noise_std_is_z_times_c_over_m(dtype: torch.dtype) -> None:
    z, bound, m = 1.3, 2.0, 4
    current = {"a": torch.zeros(200_000, dtype=dtype), "b": torch.zeros(300, 200, dtype=dtype)}
    # Updates equal to the model: what moves it is the noise alone.
    got, _ = dp_fedavg(
        current,
        [current] * m,
        clip_norm=bound,
        noise_multiplier=z,
        generator=torch.Generator().manual_seed(1234),
    )
    want_std = z * bound / m
    for name in current:
        sample = np64(got[name]).ravel()
        # Standard errors at n = 60,000: 0.4% of std for the mean, 0.3% for the std; 2% is ~6 sigma.
        assert abs(sample.mean()) < 0.02 * want_std
        assert sample.std() == pytest.approx(want_std, rel=0.02)
    assert not np.allclose(np64(got["a"][:100]), np64(got["b"].ravel()[:100]))  # each tensor its own draw


def test_noise_is_fresh_each_round_and_stays_at_the_same_std_over_many_rounds() -> None:
    z, bound, m = 0.8, 1.0, 2
    generator = torch.Generator().manual_seed(99)
    current = {"w": torch.zeros(500, dtype=torch.float64)}
    draws = []
    for _ in range(200):
        got, _ = dp_fedavg(current, [current] * m, clip_norm=bound, noise_multiplier=z, generator=generator)
        draws.append(got["w"].numpy())
    stacked = np.stack(draws)
    assert stacked.std() == pytest.approx(z * bound / m, rel=0.02)
    assert len({d.tobytes() for d in draws}) == len(draws)


def test_the_same_generator_seed_gives_bit_identical_weights_in_any_dict_order() -> None:
    g = torch.Generator().manual_seed(5)
    current = {"b": torch.randn(30, generator=g), "a": torch.randn(4, 5, generator=g)}
    updates = [{k: t + torch.randn(t.shape, generator=g) for k, t in current.items()} for _ in range(3)]
    reordered_current = {"a": current["a"], "b": current["b"]}
    reordered_updates = [{"a": u["a"], "b": u["b"]} for u in updates]
    first, _ = dp_fedavg(
        current, updates, clip_norm=1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(42)
    )
    second, _ = dp_fedavg(
        reordered_current,
        reordered_updates,
        clip_norm=1.0,
        noise_multiplier=1.0,
        generator=torch.Generator().manual_seed(42),
    )
    other, _ = dp_fedavg(
        current, updates, clip_norm=1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(43)
    )
    assert all(torch.equal(first[k], second[k]) for k in current)
    assert not torch.equal(first["a"], other["a"])
    assert list(first) == list(current)  # the result keeps the model's order


# --- adaptive clipping -----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    bound=st.floats(1e-3, 1e3),
    fraction=st.floats(-0.5, 1.5),
    target=st.floats(0.0, 1.0),
    lr=st.floats(0.0, 1.0),
)
def test_the_geometric_update_matches_andrew_et_al(
    bound: float, fraction: float, target: float, lr: float
) -> None:
    assert geometric_clip_update(bound, fraction, target_quantile=target, learning_rate=lr) == pytest.approx(
        bound * np.exp(-lr * (fraction - target)), rel=1e-12
    )


def test_the_bound_shrinks_when_too_many_went_unclipped_and_grows_when_too_few() -> None:
    assert geometric_clip_update(1.0, 0.9, target_quantile=0.5, learning_rate=0.2) < 1.0
    assert geometric_clip_update(1.0, 0.1, target_quantile=0.5, learning_rate=0.2) > 1.0
    assert geometric_clip_update(1.0, 0.5, target_quantile=0.5, learning_rate=0.2) == 1.0


def test_repeated_updates_without_noise_settle_at_the_target_quantile_of_the_norms() -> None:
    norms = np.sort(np.random.default_rng(0).lognormal(size=101))
    bound = 50.0
    for _ in range(400):
        fraction = noisy_unclipped_fraction(
            int(np.sum(norms <= bound)), len(norms), count_noise_std=0.0, generator=torch.Generator()
        )
        bound = geometric_clip_update(bound, fraction, target_quantile=0.5, learning_rate=0.2)
    # Within a step or two of the median once it oscillates around it.
    assert norms[47] <= bound <= norms[53]


def test_the_noisy_fraction_is_unbiased_with_std_sigma_b_over_m() -> None:
    generator = torch.Generator().manual_seed(3)
    draws = np.array(
        [noisy_unclipped_fraction(7, 10, count_noise_std=2.0, generator=generator) for _ in range(20_000)]
    )
    assert abs(draws.mean() - 0.7) < 0.01  # standard error 0.0014
    assert draws.std() == pytest.approx(0.2, rel=0.03)
    assert noisy_unclipped_fraction(7, 10, count_noise_std=0.0, generator=generator) == 0.7


@settings(max_examples=100, deadline=None)
@given(z=st.floats(0.1, 10.0), ratio=st.floats(1.01, 100.0))
def test_the_adjusted_multiplier_keeps_the_total_privacy_of_z(z: float, ratio: float) -> None:
    sigma_b = ratio * z / 2
    z_delta = delta_noise_multiplier(z, sigma_b)
    # Andrew et al. Thm 1: releasing both is one Gaussian mechanism with z⁻² = z_Δ⁻² + (2σ_b)⁻².
    assert z_delta**-2 + (2 * sigma_b) ** -2 == pytest.approx(z**-2, rel=1e-9)
    assert z_delta > z


def test_too_little_count_noise_is_refused_with_a_suggestion() -> None:
    with pytest.raises(AggregationError, match="must exceed noise_multiplier/2.*clients_per_round/20"):
        delta_noise_multiplier(1.0, 0.5)
    assert delta_noise_multiplier(0.0, 0.0) == 0.0  # no privacy asked: adaptive clipping alone


def test_adaptive_round_clips_at_the_old_bound_and_reports_the_next() -> None:
    current = {"w": torch.zeros(1, dtype=torch.float64)}
    updates = [{"w": torch.tensor([n], dtype=torch.float64)} for n in (0.5, 1.0, 2.0, 4.0)]
    got, report = adaptive_dp_fedavg(
        current,
        updates,
        clip_norm=1.5,
        noise_multiplier=0.0,
        count_noise_std=0.0,
        target_quantile=0.5,
        clip_learning_rate=0.2,
        generator=torch.Generator(),
    )
    assert got["w"].item() == pytest.approx((0.5 + 1.0 + 1.5 + 1.5) / 4)
    assert report.clip_norm == 1.5 and report.clipped == 2
    assert report.next_clip_norm == pytest.approx(1.5 * math.exp(-0.2 * (2 / 4 - 0.5)))
    assert report.metrics()["dp_clip_norm_next"] == report.next_clip_norm


def test_adaptive_round_noises_the_update_with_the_adjusted_multiplier() -> None:
    current = {"w": torch.zeros(100_000)}
    got, report = adaptive_dp_fedavg(
        current,
        [current] * 5,
        clip_norm=1.0,
        noise_multiplier=1.0,
        count_noise_std=0.25 * 5,
        target_quantile=0.5,
        clip_learning_rate=0.2,
        generator=torch.Generator().manual_seed(0),
    )
    z_delta = (1.0 - 2.5**-2) ** -0.5
    assert report.noise_multiplier == pytest.approx(z_delta)
    assert np64(got["w"]).std() == pytest.approx(z_delta * 1.0 / 5, rel=0.02)
    assert report.next_clip_norm is not None and report.next_clip_norm != 1.0


# --- bad input -------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_what_is_wrong() -> None:
    current = {"w": torch.zeros(2)}
    g = torch.Generator()
    with pytest.raises(AggregationError, match="no updates"):
        dp_fedavg(current, [], clip_norm=1.0, noise_multiplier=1.0, generator=g)
    with pytest.raises(AggregationError, match="clip bound must be"):
        dp_fedavg(current, [current], clip_norm=0.0, noise_multiplier=1.0, generator=g)
    with pytest.raises(AggregationError, match="noise multiplier must be"):
        dp_fedavg(current, [current], clip_norm=1.0, noise_multiplier=-1.0, generator=g)
    with pytest.raises(AggregationError, match="tensor names"):
        dp_fedavg(current, [{"v": torch.zeros(2)}], clip_norm=1.0, noise_multiplier=1.0, generator=g)
    with pytest.raises(AggregationError, match="update shape"):
        dp_fedavg(current, [{"w": torch.zeros(3)}], clip_norm=1.0, noise_multiplier=1.0, generator=g)
    with pytest.raises(AggregationError, match="not finite"):
        dp_fedavg(
            current, [{"w": torch.tensor([1.0, math.inf])}], clip_norm=1.0, noise_multiplier=1.0, generator=g
        )
    with pytest.raises(AggregationError, match="unclipped count"):
        noisy_unclipped_fraction(5, 4, count_noise_std=0.0, generator=g)
    with pytest.raises(AggregationError, match="target_quantile"):
        geometric_clip_update(1.0, 0.5, target_quantile=1.5, learning_rate=0.2)
