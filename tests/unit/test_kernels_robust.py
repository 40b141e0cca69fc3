"""Robust kernels checked against NumPy oracles written from each paper's formula, not from the kernels.

Median and trimmed mean (Yin et al. 2018), Krum and Multi-Krum (Blanchard et al. 2017),
Bulyan (El Mhamdi et al. 2018) and global-norm clipping. Each oracle works on the stacked
client values in float64 and follows the tie rules the kernels document.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmq.common.codec import index_tensors
from fedmq.common.errors import AggregationError
from fedmq.common.messages import ClientUpdate, to_wire
from fedmq.services.aggregator.kernels.robust import (
    bulyan,
    clip_to_norm,
    coordinate_median,
    krum,
    krum_select,
    pairwise_sq_distances,
    trimmed_mean,
)

StateDict = dict[str, torch.Tensor]

shapes_st = st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3)


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype in (torch.float16, torch.bfloat16):
        tensor = tensor.float()
    return tensor.numpy().astype(np.float64)


def random_states(
    rng: np.random.Generator, shapes: Sequence[tuple[int, ...]], k: int, dtype: torch.dtype = torch.float32
) -> list[StateDict]:
    return [
        {f"t{i}": torch.from_numpy(rng.normal(0, 3, size=shape)).to(dtype) for i, shape in enumerate(shapes)}
        for _ in range(k)
    ]


def stacked(states: Sequence[Mapping[str, torch.Tensor]], name: str) -> np.ndarray:
    return np.stack([as_numpy(s[name]) for s in states])


# --- oracles, from the papers ---------------------------------------------------------------


def oracle_median(states: Sequence[StateDict]) -> dict[str, np.ndarray]:
    """np.median: for an even count, the mean of the two middle values."""
    return {name: np.asarray(np.median(stacked(states, name), axis=0)) for name in states[0]}


def oracle_trimmed_mean(states: Sequence[StateDict], beta: float) -> dict[str, np.ndarray]:
    """Sort each coordinate, cut int(beta*k) from both ends, average the rest."""
    k = len(states)
    cut = int(beta * k)
    kept = {name: np.sort(stacked(states, name), axis=0)[cut : k - cut] for name in states[0]}
    return {name: np.asarray(values.mean(axis=0)) for name, values in kept.items()}


def oracle_distances(states: Sequence[StateDict]) -> np.ndarray:
    flat = np.stack([np.concatenate([as_numpy(s[n]).ravel() for n in s]) for s in states])
    return np.array([[np.sum((a - b) ** 2) for b in flat] for a in flat])


def oracle_krum_scores(distances: np.ndarray, among: list[int], closest: int) -> np.ndarray:
    """Blanchard et al.: score(i) = sum of squared distances to its `closest` nearest neighbours."""
    return np.array([np.sort([distances[i, j] for j in among if j != i])[:closest].sum() for i in among])


def oracle_krum(states: Sequence[StateDict], f: int, m: int) -> tuple[dict[str, np.ndarray], list[int]]:
    k = len(states)
    scores = oracle_krum_scores(oracle_distances(states), list(range(k)), k - f - 2)
    chosen = [int(i) for i in np.argsort(scores, kind="stable")[:m]]
    return {name: np.asarray(stacked(states, name)[chosen].mean(axis=0)) for name in states[0]}, chosen


def oracle_bulyan(states: Sequence[StateDict], f: int) -> tuple[dict[str, np.ndarray], list[int]]:
    """Recursive Krum keeps theta = k-2f; per coordinate, the mean of the theta-2f nearest the median."""
    k = len(states)
    distances = oracle_distances(states)
    theta, beta = k - 2 * f, k - 4 * f
    remaining: list[int] = list(range(k))
    chosen: list[int] = []
    while len(chosen) < theta:
        closest = min(max(1, len(remaining) - f - 2), len(remaining) - 1)
        scores = oracle_krum_scores(distances, remaining, closest)
        best = remaining[int(np.argsort(scores, kind="stable")[0])]
        chosen.append(best)
        remaining.remove(best)
    out = {}
    for name in states[0]:
        values = np.sort(stacked(states, name)[sorted(chosen)], axis=0)
        median = np.median(values, axis=0)
        nearest = np.argsort(np.abs(values - median), axis=0, kind="stable")[:beta]
        out[name] = np.asarray(np.take_along_axis(values, nearest, axis=0).mean(axis=0))
    return out, chosen


def assert_close(out: Mapping[str, torch.Tensor], expected: Mapping[str, np.ndarray], rtol: float) -> None:
    assert out.keys() == expected.keys()
    for name, tensor in out.items():
        assert tuple(tensor.shape) == expected[name].shape
        np.testing.assert_allclose(as_numpy(tensor), expected[name], rtol=rtol, atol=rtol * 10)


# --- coordinate median ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float64, torch.float32, torch.float16]),
    shapes=shapes_st,
    k=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_coordinate_median_is_numpys_median_rounded_once_to_the_dtype(
    dtype: torch.dtype, shapes: list[tuple[int, ...]], k: int, seed: int
) -> None:
    states = random_states(np.random.default_rng(seed), shapes, k, dtype)

    out = coordinate_median(states)

    for name, expected in oracle_median(states).items():
        assert out[name].dtype == dtype
        # (a+b)/2 of two values of these dtypes is exact in float32/float64 before the one rounding.
        expected_tensor = torch.from_numpy(expected).to(dtype)
        assert out[name].numpy().tobytes() == expected_tensor.numpy().tobytes()


def test_coordinate_median_of_bfloat16_is_close_to_numpys() -> None:
    states = random_states(np.random.default_rng(3), [(40,)], 6, torch.bfloat16)
    assert_close(coordinate_median(states), oracle_median(states), rtol=1e-2)


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values() -> None:
    states = [{"w": torch.tensor([v, -v])} for v in [1.0, 10.0, 2.0, 3.0]]
    assert coordinate_median(states)["w"].tolist() == [2.5, -2.5]


def test_median_ignores_a_minority_of_huge_values() -> None:
    states = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}, {"w": torch.tensor([1e30])}]
    assert coordinate_median(states)["w"].tolist() == [2.0]


def test_median_of_integer_buffers_is_the_lower_median_never_an_average() -> None:
    states = [{"n": torch.tensor([v, 5])} for v in [1, 10, 2, 3]]
    out = coordinate_median(states)
    assert out["n"].dtype == torch.int64
    assert out["n"].tolist() == [2, 5]


def test_median_of_bool_tensors_is_the_lower_median() -> None:
    states = [{"b": torch.tensor([True, False, True])}, {"b": torch.tensor([False, False, True])}]
    out = coordinate_median(states)
    assert out["b"].dtype == torch.bool
    assert out["b"].tolist() == [False, False, True]


def test_median_of_one_client_is_that_client() -> None:
    state = {"w": torch.tensor([[1.5, -2.0]]), "n": torch.tensor(7), "e": torch.empty(0, 3)}
    out = coordinate_median([state])
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_median_of_equal_updates_is_that_update() -> None:
    state = random_states(np.random.default_rng(0), [(5, 3)], 1)[0]
    out = coordinate_median([state] * 4)
    assert torch.equal(out["t0"], state["t0"])


def test_median_is_the_same_bits_whatever_the_slice_size() -> None:
    states = random_states(np.random.default_rng(1), [(300, 70), (9,)], 5)
    whole = coordinate_median(states)
    sliced = coordinate_median(states, chunk_bytes=1)  # the smallest slice: one lane of 4096 coordinates
    for name in whole:
        assert whole[name].numpy().tobytes() == sliced[name].numpy().tobytes()


# --- trimmed mean ---------------------------------------------------------------------------


@pytest.mark.slow  # a fuzzer: 26 s of the 2-minute tier
@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]),
    shapes=shapes_st,
    k=st.integers(1, 10),
    beta=st.floats(0.0, 0.49),
    seed=st.integers(0, 2**32 - 1),
)
def test_trimmed_mean_matches_sorting_cutting_and_averaging_in_numpy(
    dtype: torch.dtype, shapes: list[tuple[int, ...]], k: int, beta: float, seed: int
) -> None:
    states = random_states(np.random.default_rng(seed), shapes, k, dtype)
    rtol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert_close(trimmed_mean(states, beta), oracle_trimmed_mean(states, beta), rtol=rtol)


def test_trimmed_mean_drops_the_extremes_of_each_coordinate_separately() -> None:
    rows = [[0.0, 9.0], [1.0, 1.0], [2.0, 2.0], [9.0, 0.0], [3.0, 3.0]]
    states = [{"w": torch.tensor(row)} for row in rows]
    # beta=0.2 of 5 drops one value from each end: column 0 keeps 1, 2, 3; column 1 keeps 1, 2, 3.
    assert trimmed_mean(states, 0.2)["w"].tolist() == [2.0, 2.0]


def test_trimmed_mean_with_beta_zero_is_the_plain_mean() -> None:
    states = [{"w": torch.tensor([v])} for v in [1.0, 2.0, 6.0]]
    assert trimmed_mean(states, 0.0)["w"].tolist() == [3.0]


def test_trimmed_mean_of_one_client_is_that_client() -> None:
    state = {"w": torch.tensor([1.25, -3.5]), "n": torch.tensor([4])}
    out = trimmed_mean([state], 0.4)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_trimmed_mean_of_integer_buffers_is_the_lower_median_of_the_kept_values() -> None:
    states = [{"n": torch.tensor([v])} for v in [1, 2, 3, 4, 100]]
    assert trimmed_mean(states, 0.2)["n"].tolist() == [3]


@pytest.mark.parametrize("beta", [0.5, 0.75, -0.1, float("nan")])
def test_trimmed_mean_that_would_leave_nothing_says_the_limit(beta: float) -> None:
    states = [{"w": torch.ones(2)}] * 4
    with pytest.raises(AggregationError, match=r"beta must be in \[0, 0.5\)"):
        trimmed_mean(states, beta)


# --- Krum and Multi-Krum --------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(shapes=shapes_st, k=st.integers(1, 7), seed=st.integers(0, 2**32 - 1))
def test_pairwise_sq_distances_match_numpy(shapes: list[tuple[int, ...]], k: int, seed: int) -> None:
    states = random_states(np.random.default_rng(seed), shapes, k)
    distances = pairwise_sq_distances(states)
    assert distances.dtype == torch.float64
    np.testing.assert_allclose(distances.numpy(), oracle_distances(states), rtol=1e-12, atol=1e-12)
    assert torch.equal(distances, distances.T)
    assert torch.all(distances.diagonal() == 0)


def test_pairwise_sq_distances_leave_integer_buffers_out() -> None:
    states = [{"w": torch.tensor([v]), "n": torch.tensor([n])} for v, n in [(0.0, 0), (3.0, 9)]]
    assert pairwise_sq_distances(states).tolist() == [[0.0, 9.0], [9.0, 0.0]]


def test_pairwise_sq_distances_do_not_depend_on_the_thread_count() -> None:
    states = random_states(np.random.default_rng(2), [(200_003,)], 3, torch.float64)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            results.append(pairwise_sq_distances(states).numpy().tobytes())
    finally:
        torch.set_num_threads(threads)
    assert len(set(results)) == 1


@settings(max_examples=40, deadline=None)
@given(
    shapes=shapes_st,
    f=st.integers(0, 2),
    extra=st.integers(0, 3),
    m_frac=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_krum_and_multi_krum_match_the_papers_scores_and_mean(
    shapes: list[tuple[int, ...]], f: int, extra: int, m_frac: float, seed: int
) -> None:
    k = 2 * f + 3 + extra
    m = 1 + int(m_frac * (k - 1))
    states = random_states(np.random.default_rng(seed), shapes, k)

    out, chosen = krum(states, f, m)

    expected, expected_chosen = oracle_krum(states, f, m)
    assert chosen == expected_chosen
    assert_close(out, expected, rtol=1e-5)


def test_krum_picks_the_update_nearest_its_neighbours_not_the_outliers() -> None:
    honest = [{"w": torch.tensor([v, 1.0])} for v in [1.0, 1.1, 1.2, 1.35, 1.5]]
    poisoned = [{"w": torch.tensor([-100.0, 100.0])}, {"w": torch.tensor([100.0, -100.0])}]
    out, chosen = krum(honest + poisoned, f=2)
    # Scores over the 3 nearest: 1.2 -> .01+.0225+.04 = .0725, the lowest (1.1: .0825, 1.35: .1075).
    assert chosen == [2]
    assert torch.equal(out["w"], honest[2]["w"])


def test_krum_of_equal_updates_chooses_the_lowest_indices() -> None:
    state = {"w": torch.tensor([0.5, 0.25]), "n": torch.tensor(3)}
    out, chosen = krum([state] * 5, f=1, m=3)
    assert chosen == [0, 1, 2]
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["n"], state["n"])


def test_krum_weights_the_mean_of_the_selected_updates() -> None:
    states = [{"w": torch.tensor([float(v)])} for v in [0, 1, 2, 3, 100]]
    out, chosen = krum(states, f=1, m=2, weights=[1, 3, 1, 1, 1])
    expected, expected_chosen = oracle_krum(states, 1, 2)
    assert chosen == expected_chosen
    assert sorted(chosen) == [1, 2]
    assert out["w"].tolist() == [(1 * 3 + 2 * 1) / 4]


def test_multi_krum_takes_the_lower_median_of_the_selected_integer_buffers() -> None:
    states = [{"w": torch.tensor([float(i)]), "n": torch.tensor([10 * i])} for i in range(6)]
    out, chosen = krum(states, f=1, m=3)
    assert sorted(chosen) == [1, 2, 3]
    assert out["n"].tolist() == [20]


@pytest.mark.parametrize("f", [0, 1, 3])
def test_krum_works_with_f_at_its_limit_and_refuses_one_client_fewer(f: int) -> None:
    states = random_states(np.random.default_rng(f), [(4,)], 2 * f + 3)
    out, chosen = krum(states, f)
    expected, expected_chosen = oracle_krum(states, f, 1)
    assert chosen == expected_chosen
    assert_close(out, expected, rtol=1e-6)
    message = f"krum with f={f} needs at least {2 * f + 3} clients, got {2 * f + 2}: lower f or select more"
    with pytest.raises(AggregationError, match=message):
        krum(states[:-1], f)


def test_krum_of_one_client_is_refused() -> None:
    with pytest.raises(AggregationError, match="krum with f=0 needs at least 3 clients, got 1"):
        krum([{"w": torch.ones(1)}], 0)


@pytest.mark.parametrize("m", [0, 6])
def test_krum_refuses_m_outside_one_to_k(m: int) -> None:
    with pytest.raises(AggregationError, match="1 <= m <= 5"):
        krum_select(torch.zeros(5, 5, dtype=torch.float64), 1, m)


def test_krum_select_needs_a_square_matrix() -> None:
    with pytest.raises(AggregationError, match="k x k"):
        krum_select(torch.zeros(3, 4, dtype=torch.float64), 0)


# --- Bulyan ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(shapes=shapes_st, f=st.integers(0, 2), extra=st.integers(0, 3), seed=st.integers(0, 2**32 - 1))
def test_bulyan_matches_recursive_krum_then_the_mean_closest_to_the_median(
    shapes: list[tuple[int, ...]], f: int, extra: int, seed: int
) -> None:
    states = random_states(np.random.default_rng(seed), shapes, 4 * f + 3 + extra)

    out, chosen = bulyan(states, f)

    expected, expected_chosen = oracle_bulyan(states, f)
    assert chosen == expected_chosen
    assert_close(out, expected, rtol=1e-5)


def test_bulyan_breaks_equal_distances_to_the_median_toward_the_lower_value() -> None:
    # k=7, f=1: theta=5 keeps 0, 1, 2, 4, 5 (not 30 or 1000); beta=3 around their median 2
    # takes 2, 1 and then 0 or 4 (both 2 away): the lower, 0. The mean is 1, not 7/3.
    states = [{"w": torch.tensor([v])} for v in [5.0, 1000.0, 0.0, 2.0, 1.0, 4.0, 30.0]]
    out, chosen = bulyan(states, 1)
    assert sorted(chosen) == [0, 2, 3, 4, 5]
    assert out["w"].tolist() == [1.0]
    expected, expected_chosen = oracle_bulyan(states, 1)
    assert chosen == expected_chosen and expected["w"].tolist() == [1.0]


@pytest.mark.parametrize("f", [0, 1, 2])
def test_bulyan_works_with_f_at_its_limit_and_refuses_one_client_fewer(f: int) -> None:
    states = random_states(np.random.default_rng(10 + f), [(3, 2)], 4 * f + 3)
    out, chosen = bulyan(states, f)
    expected, expected_chosen = oracle_bulyan(states, f)
    assert chosen == expected_chosen
    assert_close(out, expected, rtol=1e-6)
    message = f"bulyan with f={f} needs at least {4 * f + 3} clients, got {4 * f + 2}: lower f or select more"
    with pytest.raises(AggregationError, match=message):
        bulyan(states[:-1], f)


def test_bulyan_of_equal_updates_is_that_update() -> None:
    state = {"w": torch.tensor([0.5, -0.75]), "n": torch.tensor(2)}
    out, chosen = bulyan([state] * 7, 1)
    assert chosen == [0, 1, 2, 3, 4]
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["n"], state["n"])


# --- norm clipping --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]),
    shapes=shapes_st,
    max_norm=st.floats(1e-3, 50.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_clip_to_norm_scales_by_min_one_and_bound_over_norm_and_never_exceeds_the_bound(
    dtype: torch.dtype, shapes: list[tuple[int, ...]], max_norm: float, seed: int
) -> None:
    delta = random_states(np.random.default_rng(seed), shapes, 1, dtype)[0]
    flat = np.concatenate([as_numpy(t).ravel() for t in delta.values()])
    norm = float(np.sqrt(np.sum(flat**2)))

    clipped, reported = clip_to_norm(delta, max_norm)

    assert reported == pytest.approx(norm, rel=1e-12)
    clipped_flat = np.concatenate([as_numpy(t).ravel() for t in clipped.values()])
    assert np.sqrt(np.sum(clipped_flat**2)) <= max_norm
    rtol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    np.testing.assert_allclose(clipped_flat, flat * min(1.0, max_norm / norm), rtol=2 * rtol, atol=1e-6)
    assert all(clipped[n].dtype == dtype for n in delta)


def test_clip_to_norm_leaves_a_small_update_and_integer_buffers_unchanged() -> None:
    delta = {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor([100])}
    clipped, norm = clip_to_norm(delta, 10.0)
    assert norm == 5.0
    assert torch.equal(clipped["w"], delta["w"]) and torch.equal(clipped["n"], delta["n"])
    clipped, norm = clip_to_norm(delta, 1.0)
    assert clipped["w"].tolist() == pytest.approx([0.6, 0.8])
    assert clipped["n"].tolist() == [100]


def test_clip_to_norm_does_not_modify_its_input() -> None:
    delta = {"w": torch.tensor([30.0, 40.0], dtype=torch.float64)}
    clip_to_norm(delta, 1.0)
    assert delta["w"].tolist() == [30.0, 40.0]


@pytest.mark.parametrize("bound", [0.0, -1.0, float("inf"), float("nan")])
def test_clip_to_norm_refuses_a_bound_that_is_not_positive_and_finite(bound: float) -> None:
    with pytest.raises(AggregationError, match="finite max_norm > 0"):
        clip_to_norm({"w": torch.ones(2)}, bound)


# --- shared behaviour: lazy files, bad input, determinism -----------------------------------


class CountingState(Mapping[str, torch.Tensor]):
    """A state dict that counts how often each tensor is read."""

    def __init__(self, state: StateDict) -> None:
        self.state = state
        self.reads: dict[str, int] = dict.fromkeys(state, 0)

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads[name] += 1
        return self.state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def write_update(path: Path, client: int, weights: StateDict) -> Path:
    message = ClientUpdate(
        job_id="job", task_id=f"t{client}", round=1, client=client, base_digest="ab" * 32,
        num_examples=10, metrics={}, weights=weights,
    )
    path.write_bytes(to_wire(message))
    return path


def test_kernels_read_lazy_update_files_and_agree_with_in_memory_states(tmp_path: Path) -> None:
    states = random_states(np.random.default_rng(5), [(6, 4), (3,)], 7)
    for state in states:
        state["n"] = torch.tensor(5)
    files = [index_tensors(write_update(tmp_path / f"c{i}.msg", i, s)) for i, s in enumerate(states)]
    pairs = [
        (coordinate_median(files), coordinate_median(states)),
        (trimmed_mean(files, 0.3), trimmed_mean(states, 0.3)),
        (krum(files, 2, 2)[0], krum(states, 2, 2)[0]),
        (bulyan(files, 1)[0], bulyan(states, 1)[0]),
    ]
    for from_files, in_memory in pairs:
        assert from_files.keys() == in_memory.keys()
        for name in in_memory:
            assert from_files[name].numpy().tobytes() == in_memory[name].numpy().tobytes()


def test_a_tensor_that_fits_one_slice_is_read_once_per_client_and_a_larger_one_once_per_slice() -> None:
    states = [CountingState(s) for s in random_states(np.random.default_rng(6), [(10,), (3, 4096)], 3)]
    coordinate_median(states, chunk_bytes=3 * 4 * 4096)  # one lane of 4096 float32 coordinates per slice
    # One read to learn the layout (a plain mapping has no index to ask), then one per slice.
    assert [s.reads for s in states] == [{"t0": 1 + 1, "t1": 1 + 3}] * 3


@pytest.mark.parametrize(
    "kernel",
    [coordinate_median, lambda u: trimmed_mean(u, 0.1), lambda u: krum(u, 0), lambda u: bulyan(u, 0)],
    ids=["median", "trimmed", "krum", "bulyan"],
)
def test_bad_sets_of_updates_are_aggregation_errors(kernel: Callable[[list[StateDict]], object]) -> None:
    ok = {"w": torch.ones(2)}
    cases = [
        ([], "needs at least one update"),
        ([ok, ok, {"v": torch.ones(2)}], "disagrees with update 0 on tensor names"),
        ([ok, ok, {"w": torch.ones(3)}], "update 2 has"),
        ([ok, ok, {"w": torch.ones(2, dtype=torch.float64)}], "update 2 has"),
        ([{"z": torch.ones(2, dtype=torch.complex64)}] * 3, "takes real tensors"),
    ]
    for updates, message in cases:
        with pytest.raises(AggregationError, match=message):
            kernel(updates)


def test_every_kernel_gives_the_same_bits_on_the_same_inputs() -> None:
    states = random_states(np.random.default_rng(7), [(33, 5), (7,)], 11)
    runs = [
        lambda: coordinate_median(states),
        lambda: trimmed_mean(states, 0.2),
        lambda: krum(states, 2, 4)[0],
        lambda: bulyan(states, 2)[0],
        lambda: clip_to_norm(states[0], 0.5)[0],
    ]
    for run in runs:
        first, second = run(), run()
        for name in first:
            assert first[name].numpy().tobytes() == second[name].numpy().tobytes()


def test_robust_rules_shrug_off_three_of_ten_clients_sending_scaled_updates() -> None:
    rng = np.random.default_rng(8)
    honest = [{"w": torch.from_numpy(rng.normal(1.0, 0.1, size=50)).float()} for _ in range(7)]
    attackers = [{"w": s["w"] * -100} for s in honest[:3]]
    updates = honest + attackers
    truth = torch.stack([s["w"] for s in honest]).mean(0)
    results = {
        "median": coordinate_median(updates),
        "trimmed": trimmed_mean(updates, 0.3),
        "krum": krum(updates, 3)[0],
        "multi-krum": krum(updates, 3, 4)[0],
    }
    for name, out in results.items():
        assert torch.allclose(out["w"], truth, atol=0.3), name
