"""Aggregation kernels and strategies, checked against an independent numpy oracle."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmq.common.codec import TensorFile, index_tensors, packb, readahead
from fedmq.common.errors import AggregationError, DecodeError
from fedmq.common.jobspec import parse_job
from fedmq.common.strategy.contract import ClientResult, RoundContext, Strategy
from fedmq.common.strategy.loading import make_strategy
from fedmq.services.aggregator.kernels import mean, server_momentum, weighted_mean
from fedmq.services.aggregator.strategies.average import Average
from fedmq.services.aggregator.strategies.fedavg import FedAvg
from fedmq.services.aggregator.strategies.fedavgm import FedAvgM

StateDict = dict[str, torch.Tensor]


def aggregate(
    strategy: Strategy, server_round: int, current: StateDict, results: Sequence[ClientResult]
) -> StateDict:
    """The new weights a strategy computes for a round with no failures."""
    ctx = RoundContext(round=server_round, rounds=10, seed=0, num_clients=len(results))
    return dict(strategy.aggregate(ctx, current, results, []).weights)


def fedavgm(server_lr: float, server_momentum: float) -> FedAvgM:
    return FedAvgM(FedAvgM.Options(server_lr=server_lr, server_momentum=server_momentum))

# Relative tolerance per dtype: a few ulps of the output dtype (accumulation is in float32+).
RTOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """float64 numpy copy; bfloat16 has no numpy dtype, so go through float32 (exact)."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        tensor = tensor.float()
    return tensor.numpy().astype(np.float64)


def oracle(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict:
    """np.average over the stacked tensors, in float64."""
    return {
        name: np.average(np.stack([as_numpy(s[name]) for s in states]), axis=0, weights=np.asarray(weights))
        for name in states[0]
    }


def random_states(
    rng: np.random.Generator, shapes: Sequence[tuple[int, ...]], n: int, dtype: torch.dtype
) -> list[StateDict]:
    return [
        {
            f"layer{i}.weight": torch.from_numpy(rng.uniform(-10, 10, size=shape)).to(dtype)
            for i, shape in enumerate(shapes)
        }
        for _ in range(n)
    ]


def result(client: int, num_examples: int, state: StateDict) -> ClientResult:
    return ClientResult(client=client, num_examples=num_examples, loader=lambda: state)


shapes_st = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3)


# --- weighted_mean against the oracle --------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]),
    shapes=shapes_st,
    weights=st.lists(st.floats(0.0, 1000.0), min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_weighted_mean_matches_numpy_average_for_float_dtypes(
    dtype: torch.dtype, shapes: list[tuple[int, ...]], weights: list[float], seed: int
) -> None:
    weights = [*weights[:-1], weights[-1] + 0.5]  # keep the total positive
    states = random_states(np.random.default_rng(seed), shapes, len(weights), dtype)

    out = weighted_mean(zip(states, weights, strict=True))

    expected = oracle(states, weights)
    assert out.keys() == expected.keys()
    for name, tensor in out.items():
        assert tensor.dtype == dtype
        assert tuple(tensor.shape) == expected[name].shape
        # Values lie in [-10, 10], so absolute error is bounded by rtol * 10.
        np.testing.assert_allclose(as_numpy(tensor), expected[name], rtol=RTOL[dtype], atol=RTOL[dtype] * 10)


@settings(max_examples=40, deadline=None)
@given(
    shapes=shapes_st,
    weights=st.lists(st.integers(0, 50), min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_weighted_mean_of_int64_buffers_is_the_rounded_oracle(
    shapes: list[tuple[int, ...]], weights: list[int], seed: int
) -> None:
    weights = [*weights[:-1], weights[-1] + 1]
    rng = np.random.default_rng(seed)
    states = [
        {f"t{i}": torch.from_numpy(rng.integers(-1000, 1000, size=s)) for i, s in enumerate(shapes)}
        for _ in weights
    ]

    out = weighted_mean(zip(states, weights, strict=True))

    for name, expected in oracle(states, weights).items():
        assert out[name].dtype == torch.int64
        # Half-way cases round to even in both np.rint and torch.round.
        np.testing.assert_array_equal(out[name].numpy(), np.rint(expected).astype(np.int64))


def test_weighted_mean_of_a_single_result_is_that_result() -> None:
    state = {"w": torch.tensor([1.5, -2.0]), "n": torch.tensor(7)}
    out = weighted_mean([(state, 3.0)])
    assert torch.equal(out["w"], state["w"])
    assert torch.equal(out["n"], state["n"])


def test_weighted_mean_rounds_integer_means_half_to_even() -> None:
    out = weighted_mean([({"n": torch.tensor([1, 2])}, 1.0), ({"n": torch.tensor([2, 3])}, 1.0)])
    assert out["n"].tolist() == [2, 2]  # 1.5 -> 2, 2.5 -> 2


def test_weighted_mean_keeps_each_tensors_dtype_in_a_mixed_state() -> None:
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64]
    states = [{str(d): torch.ones(2, dtype=d) * (k + 1) for d in dtypes} for k in range(3)]
    out = weighted_mean((s, 1.0) for s in states)
    assert {name: t.dtype for name, t in out.items()} == {str(d): d for d in dtypes}
    assert all(t.tolist() == [2, 2] for t in out.values())


def test_weighted_mean_does_not_modify_its_inputs() -> None:
    states = random_states(np.random.default_rng(0), [(3, 2)], 3, torch.float32)
    before = [{k: v.clone() for k, v in s.items()} for s in states]
    weighted_mean(zip(states, [2.0, 3.0, 5.0], strict=True))
    for s, b in zip(states, before, strict=True):
        assert all(torch.equal(s[k], b[k]) for k in s)


def test_weighted_mean_is_bit_identical_when_folding_the_same_results_twice() -> None:
    states = random_states(np.random.default_rng(1), [(17, 5), (5,)], 6, torch.float32)
    weights = [3.0, 1.0, 7.5, 2.25, 0.0, 11.0]
    first = weighted_mean(zip(states, weights, strict=True))
    second = weighted_mean(zip(states, weights, strict=True))
    for name in first:
        assert first[name].numpy().tobytes() == second[name].numpy().tobytes()


def test_a_zero_weight_result_does_not_move_the_mean() -> None:
    out = weighted_mean([({"w": torch.tensor([2.0])}, 1.0), ({"w": torch.tensor([100.0])}, 0.0)])
    assert out["w"].tolist() == [2.0]


def test_zero_total_weight_is_an_aggregation_error() -> None:
    with pytest.raises(AggregationError, match="total weight is zero"):
        weighted_mean([({"w": torch.ones(2)}, 0.0), ({"w": torch.ones(2)}, 0.0)])


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf"), float("-inf")])
def test_a_negative_or_non_finite_weight_is_an_aggregation_error(weight: float) -> None:
    with pytest.raises(AggregationError, match="weight must be finite and non-negative"):
        weighted_mean([({"w": torch.ones(2)}, 1.0), ({"w": torch.ones(2)}, weight)])


def test_no_results_is_an_aggregation_error() -> None:
    with pytest.raises(AggregationError, match="no results to aggregate"):
        weighted_mean([])


@pytest.mark.parametrize(
    "other",
    [{"b": torch.ones(2)}, {"a": torch.ones(2), "b": torch.ones(2)}, {}],
    ids=["renamed", "extra", "empty"],
)
def test_results_with_different_tensor_names_are_an_aggregation_error(other: StateDict) -> None:
    with pytest.raises(AggregationError, match="results disagree on tensor names"):
        weighted_mean([({"a": torch.ones(2)}, 1.0), (other, 1.0)])


def test_an_empty_first_result_is_an_aggregation_error() -> None:
    with pytest.raises(AggregationError):
        weighted_mean([({}, 5.0), ({"a": torch.ones(2)}, 1.0)])


@pytest.mark.parametrize(
    ("first", "second"), [((3,), (1,)), ((1,), (3,))], ids=["broadcastable", "incompatible"]
)
def test_results_with_different_shapes_are_an_aggregation_error(
    first: tuple[int, ...], second: tuple[int, ...]
) -> None:
    with pytest.raises(AggregationError):
        weighted_mean([({"a": torch.ones(first)}, 1.0), ({"a": torch.zeros(second)}, 1.0)])


@pytest.mark.filterwarnings("ignore:Casting complex values to real:UserWarning")
def test_weighted_mean_of_complex_tensors_keeps_the_imaginary_part() -> None:
    states = [{"z": torch.tensor([1 + 2j], dtype=torch.complex64)}] * 2
    out = weighted_mean((s, 1.0) for s in states)
    assert out["z"].dtype == torch.complex64
    assert out["z"].tolist() == [1 + 2j]


# --- strategies ------------------------------------------------------------------------------


def round_inputs(seed: int) -> tuple[StateDict, list[ClientResult]]:
    rng = np.random.default_rng(seed)
    current = random_states(rng, [(4, 3), (3,)], 1, torch.float32)[0]
    states = random_states(rng, [(4, 3), (3,)], 4, torch.float32)
    results = [result(c, int(n), s) for c, (n, s) in enumerate(zip([10, 30, 5, 55], states, strict=True))]
    return current, results


def assert_close_to(actual: StateDict, expected: Mapping[str, np.ndarray], rtol: float) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in actual.items():
        np.testing.assert_allclose(as_numpy(tensor), expected[name], rtol=rtol, atol=rtol * 10)


def test_fedavg_weights_each_client_by_its_number_of_examples() -> None:
    current, results = round_inputs(2)
    out = aggregate(FedAvg(), 1, current, results)
    expected = oracle([r.load() for r in results], [r.num_examples for r in results])
    assert_close_to(out, expected, RTOL[torch.float32])


def test_average_ignores_the_number_of_examples() -> None:
    current, results = round_inputs(3)
    out = aggregate(Average(), 1, current, results)
    expected = oracle([r.load() for r in results], [1.0] * len(results))
    assert_close_to(out, expected, RTOL[torch.float32])


def test_fedavg_loads_each_result_once() -> None:
    calls: list[int] = []
    state = {"w": torch.ones(2)}

    def load(client: int) -> StateDict:
        calls.append(client)
        return state

    results = [ClientResult(c, 1, loader=functools.partial(load, c)) for c in range(3)]
    aggregate(FedAvg(), 1, state, results)
    assert calls == [0, 1, 2]


def test_fedavg_is_bit_identical_across_calls_with_the_same_results() -> None:
    current, results = round_inputs(4)
    first, second = aggregate(FedAvg(), 1, current, results), aggregate(FedAvg(), 1, current, results)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_fedavgm_without_momentum_and_unit_lr_equals_fedavg() -> None:
    current, results = round_inputs(5)
    fedavg = aggregate(FedAvg(), 1, current, results)
    strategy = fedavgm(server_lr=1.0, server_momentum=0.0)
    for server_round in (1, 2):
        out = aggregate(strategy, server_round, current, results)
        for name in fedavg:
            torch.testing.assert_close(out[name], fedavg[name], rtol=1e-5, atol=1e-5)


def test_fedavgm_follows_the_hand_computed_two_round_momentum_sequence() -> None:
    lr, beta = 0.7, 0.9
    w0, round1 = round_inputs(6)
    _, round2 = round_inputs(7)
    strategy = fedavgm(server_lr=lr, server_momentum=beta)

    w1 = aggregate(strategy, 1, w0, round1)
    w2 = aggregate(strategy, 2, w1, round2)

    n1 = [r.num_examples for r in round1]
    n2 = [r.num_examples for r in round2]
    avg1 = oracle([r.load() for r in round1], n1)
    avg2 = oracle([r.load() for r in round2], n2)
    for name in w0:
        x0 = as_numpy(w0[name])
        v1 = x0 - avg1[name]
        x1 = x0 - lr * v1
        v2 = beta * v1 + (x1 - avg2[name])
        x2 = x1 - lr * v2
        np.testing.assert_allclose(as_numpy(w1[name]), x1, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(as_numpy(w2[name]), x2, rtol=1e-5, atol=1e-4)
        assert w2[name].dtype == torch.float32


def test_fedavgm_takes_integer_buffers_from_the_average_without_momentum() -> None:
    current = {"w": torch.zeros(2), "steps": torch.tensor(0)}
    results = [
        result(0, 1, {"w": torch.ones(2), "steps": torch.tensor(10)}),
        result(1, 3, {"w": torch.ones(2), "steps": torch.tensor(20)}),
    ]
    strategy = fedavgm(server_lr=1.0, server_momentum=0.9)
    out = aggregate(strategy, 1, current, results)
    assert out["steps"].item() == 18  # (10 + 3*20) / 4 = 17.5, rounded half to even
    assert set(strategy.state()) == {"velocity.w"}


def test_fedavgm_state_round_trip_makes_a_resumed_strategy_take_the_identical_step() -> None:
    w0, round1 = round_inputs(8)
    _, round2 = round_inputs(9)
    original = fedavgm(server_lr=0.5, server_momentum=0.8)
    w1 = aggregate(original, 1, w0, round1)
    saved = {k: v.clone() for k, v in original.state().items()}
    assert set(saved) == {f"velocity.{name}" for name in w0}

    resumed = fedavgm(server_lr=0.5, server_momentum=0.8)
    resumed.load_state(saved)
    expected = aggregate(original, 2, w1, round2)
    got = aggregate(resumed, 2, w1, round2)

    assert all(torch.equal(got[k], expected[k]) for k in expected)
    fresh = aggregate(fedavgm(server_lr=0.5, server_momentum=0.8), 2, w1, round2)
    assert not all(torch.equal(fresh[k], expected[k]) for k in expected), "velocity mattered"


def test_fedavgm_load_state_copies_the_tensors_it_is_given() -> None:
    strategy = fedavgm(server_lr=1.0, server_momentum=0.5)
    given_state = {"velocity.w": torch.ones(2)}
    strategy.load_state(given_state)
    given_state["velocity.w"].zero_()
    assert strategy.state()["velocity.w"].tolist() == [1.0, 1.0]


def test_a_fresh_fedavgm_has_no_state_and_loading_empty_state_keeps_it_fresh() -> None:
    strategy = fedavgm(server_lr=1.0, server_momentum=0.5)
    assert strategy.state() == {}
    strategy.load_state({})
    assert strategy.state() == {}
    assert FedAvg().state() == {}


def test_server_momentum_does_not_modify_the_velocity_it_is_given() -> None:
    velocity = {"w": torch.ones(2)}
    _, new_velocity = server_momentum(
        {"w": torch.zeros(2)}, {"w": torch.ones(2)}, velocity, lr=1.0, momentum=0.5
    )
    assert velocity["w"].tolist() == [1.0, 1.0]
    assert new_velocity["w"].tolist() == [-0.5, -0.5]


@pytest.mark.parametrize(
    ("strategy", "expected_type"),
    [({"name": "fedavg"}, FedAvg), ({"name": "average"}, Average), ({"name": "fedavgm"}, FedAvgM)],
)
def test_make_strategy_maps_each_spec_name_to_its_class(
    strategy: dict[str, str], expected_type: type
) -> None:
    spec = parse_job({"name": "j", "task": "digits", "clients": {"total": 2}, "rounds": 1,
                      "strategy": strategy})
    assert type(make_strategy(spec.strategy)) is expected_type


def test_make_strategy_passes_fedavgm_hyperparameters_through_from_the_legacy_flat_form() -> None:
    spec = parse_job(
        {
            "name": "j",
            "task": "digits",
            "clients": {"total": 2},
            "rounds": 1,
            "strategy": {"name": "fedavgm", "server_lr": 0.3, "server_momentum": 0.6},
        }
    )
    strategy = make_strategy(spec.strategy)
    assert isinstance(strategy, FedAvgM)
    assert (strategy.options.server_lr, strategy.options.server_momentum) == (0.3, 0.6)


def _files(tmp_path: Path, states: Sequence[StateDict]) -> list[TensorFile]:
    out = []
    for i, state in enumerate(states):
        path = tmp_path / f"u{i}.msg"
        path.write_bytes(packb({"weights": state}))
        out.append(index_tensors(path))
    return out


@pytest.mark.parametrize("read_ahead_bytes", [0, 1 << 40])  # every tensor read ahead; none
def test_weighted_mean_of_stored_updates_is_bit_identical_to_the_same_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_ahead_bytes: int
) -> None:
    monkeypatch.setattr(readahead, "READ_AHEAD_BYTES", read_ahead_bytes)
    gen = torch.Generator().manual_seed(3)
    states = [{"w": torch.randn(64, 33, generator=gen), "b": torch.randn(7, generator=gen).double(),
               "n": torch.tensor([i], dtype=torch.int64)} for i in range(6)]
    weights = [1.0, 2.5, 0.0, 3.0, 7.0, 0.5]
    files = _files(tmp_path, states)
    stored = mean.WeightedMean(zip(files, weights, strict=True))
    expected = weighted_mean(zip(states, weights, strict=True))
    for name, tensor in expected.items():
        first, again = stored[name], stored[name]
        assert torch.equal(first, tensor) and first.dtype == tensor.dtype
        assert torch.equal(again, tensor) and first.data_ptr() != again.data_ptr()  # a fresh tensor each read
    assert all(torch.equal(file["w"], state["w"]) for file, state in zip(files, states, strict=True))


def test_a_stored_update_that_cannot_be_read_fails_the_mean_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(readahead, "READ_AHEAD_BYTES", 0)
    states = [{"w": torch.full((100,), float(i))} for i in range(5)]
    files = _files(tmp_path, states)
    Path(files[3].path).write_bytes(b"changed")  # rewritten since it was indexed
    with pytest.raises(DecodeError, match="changed since it was indexed"):
        mean.WeightedMean((f, 1.0) for f in files)["w"]
    files = _files(tmp_path, states)
    assert torch.equal(mean.WeightedMean((f, 1.0) for f in files)["w"], torch.full((100,), 2.0))


def test_a_mean_computed_at_once_has_the_bits_of_one_read_tensor_by_tensor() -> None:
    from fedmq.services.aggregator.kernels.mean import WeightedMean

    gen = torch.Generator().manual_seed(7)
    results = []
    for k in range(7):
        state = {
            "w": torch.randn(33, 17, generator=gen) * 10 ** (k % 3),
            "b64": torch.randn(5, dtype=torch.float64, generator=gen),
            "half": torch.randn(4, generator=gen).half(),  # folded in float32, read alone
            "steps": torch.tensor(k * 3 + 1),  # an integer buffer, rounded
            "t": torch.randn(6, 2, generator=gen).t(),  # not contiguous
            "mixed": torch.randn(3, generator=gen).to(torch.float64 if k == 4 else torch.float32),
        }
        results.append((state, float(k + 1) / 3))
    at_once = WeightedMean(results).compute()
    one_by_one = WeightedMean(results)
    assert list(at_once) == list(results[0][0])
    for name, tensor in at_once.items():
        alone = one_by_one[name]
        assert tensor.dtype == alone.dtype == results[0][0][name].dtype
        bits = [t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t for t in (tensor, alone)]
        assert torch.equal(*bits) and tensor.stride() == alone.stride(), name
