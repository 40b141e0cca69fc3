"""The robust strategies (median, trimmed_mean, krum, multi_krum, bulyan) through Strategy.aggregate.

The kernels have their own oracle tests (test_kernels_robust.py); these check what the
strategies add: the registry names and options, client results read lazily tensor by
tensor from spooled update files, the rule applied to the clients' weights, and the metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fedmq
from fedmq.common.codec import TensorFile
from fedmq.common.errors import AggregationError, ConfigError
from fedmq.common.jobspec import StrategySpec
from fedmq.common.messages import ClientUpdate, to_wire
from fedmq.common.strategy.loading import make_strategy, strategy_options
from fedmq.services.aggregator.rounds import client_results
from fedmq.services.aggregator.store import JobStore

CTX = fedmq.RoundContext(round=1, rounds=1, seed=0, num_clients=10)
CURRENT = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "steps": torch.zeros((), dtype=torch.int64)}


def client_weights(k: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """k clients' weights near 1 (float32), with an integer step counter each."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {"w": 1 + 0.1 * torch.randn(2, 3, generator=generator),
         "b": 1 + 0.1 * torch.randn(3, generator=generator),
         "steps": torch.tensor(10 + i, dtype=torch.int64)}
        for i in range(k)
    ]


class Recorded(Mapping[str, torch.Tensor]):
    """A client's weights that log each tensor read, like a lazy TensorFile."""

    def __init__(self, client: int, weights: dict[str, torch.Tensor], reads: list[tuple[int, str]]) -> None:
        self.client, self.weights, self.reads = client, weights, reads

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads.append((self.client, name))
        return self.weights[name].clone()

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def results_of(weights: list[dict[str, torch.Tensor]], reads: list[tuple[int, str]] | None = None,
               ) -> list[fedmq.ClientResult]:
    log = reads if reads is not None else []
    return [
        fedmq.ClientResult(i, 10 * (i + 1), loader=lambda i=i, w=w: Recorded(i, w, log))  # type: ignore[misc]
        for i, w in enumerate(weights)
    ]


def run(name: str, weights: list[dict[str, torch.Tensor]], **options: Any) -> fedmq.Aggregate:
    strategy = make_strategy(StrategySpec(name=name, options=options))
    return strategy.aggregate(CTX, CURRENT, results_of(weights), [])


def stacked(weights: list[dict[str, torch.Tensor]], name: str) -> np.ndarray:
    return np.stack([w[name].numpy().astype(np.float64) for w in weights])


def test_median_is_the_coordinate_median_of_the_clients_weights_and_all_are_selected() -> None:
    weights = client_weights(5)
    out = run("median", weights)
    for name in ("w", "b"):
        expected = np.median(stacked(weights, name), axis=0)
        np.testing.assert_allclose(out.weights[name].numpy(), expected, rtol=1e-6)
        assert out.weights[name].dtype == torch.float32
    assert out.weights["steps"].item() == 12 and out.weights["steps"].dtype == torch.int64
    assert out.metrics == {"selected": 5.0}


def test_trimmed_mean_drops_floor_beta_k_from_each_end_per_coordinate_and_counts_every_client() -> None:
    weights = client_weights(10)
    out = run("trimmed_mean", weights, beta=0.3)
    for name in ("w", "b"):
        ordered = np.sort(stacked(weights, name), axis=0)
        np.testing.assert_allclose(out.weights[name].numpy(), ordered[3:7].mean(axis=0), rtol=1e-6)
    assert out.metrics == {"selected": 10.0}


def with_outliers(k: int, bad: list[int], scale: float = 100.0) -> list[dict[str, torch.Tensor]]:
    """k clients near 1, those in `bad` pushed far away (a 100x scaled update)."""
    weights = client_weights(k)
    for i in bad:
        weights[i] = {n: t * scale if t.is_floating_point() else t for n, t in weights[i].items()}
    return weights


def test_krum_picks_one_honest_client_and_drops_the_rest() -> None:
    weights = with_outliers(7, [2])
    out = run("krum", weights, f=1)
    picked = [i for i, w in enumerate(weights) if torch.equal(w["w"], out.weights["w"])]
    assert len(picked) == 1 and picked[0] != 2, "the aggregate is one honest client's weights"
    assert out.metrics == {"selected": 1.0, "dropped": 6.0}


def test_multi_krum_averages_the_k_minus_f_best_which_leave_out_the_attackers() -> None:
    weights = with_outliers(10, [0, 4, 7])
    out = run("multi_krum", weights, f=3)
    honest = [w for i, w in enumerate(weights) if i not in (0, 4, 7)]
    for name in ("w", "b"):
        np.testing.assert_allclose(out.weights[name].numpy(), stacked(honest, name).mean(axis=0), rtol=1e-6)
    assert out.metrics == {"selected": 7.0, "dropped": 3.0}


def test_multi_krum_with_m_given_averages_that_many() -> None:
    out = run("multi_krum", with_outliers(10, [0, 4, 7]), f=3, m=2)
    assert out.metrics == {"selected": 2.0, "dropped": 8.0}


def test_bulyan_keeps_theta_k_minus_2f_and_its_aggregate_stays_among_the_honest_values() -> None:
    weights = with_outliers(7, [5])
    out = run("bulyan", weights, f=1)
    honest = [w for i, w in enumerate(weights) if i != 5]
    for name in ("w", "b"):
        values = stacked(honest, name)
        got = out.weights[name].numpy()
        assert (got >= values.min(axis=0) - 1e-6).all() and (got <= values.max(axis=0) + 1e-6).all()
    assert out.metrics == {"selected": 5.0, "dropped": 2.0}


def spool(tmp_path: Path, weights: list[dict[str, torch.Tensor]]) -> JobStore:
    """The clients' updates written as the aggregator spools them, for round 1."""
    store = JobStore(tmp_path, "job")
    for client, w in enumerate(weights):
        update = ClientUpdate(job_id="job", task_id=f"t{client}", round=1, client=client,
                              base_digest="00" * 32, num_examples=10 + client, weights=w)
        store.put_update(1, client, to_wire(update))
    return store


@pytest.mark.parametrize(("name", "options"), [("median", {}), ("trimmed_mean", {"beta": 0.2}),
                                               ("krum", {"f": 1}), ("multi_krum", {"f": 1}),
                                               ("bulyan", {"f": 1})])
def test_a_robust_strategy_reads_each_spooled_update_once_lazily_and_tensor_by_tensor(
    name: str, options: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = spool(tmp_path, client_weights(7))
    reads: list[tuple[int, str]] = []
    read = TensorFile.__getitem__

    def recorded(self: TensorFile, tensor: str) -> torch.Tensor:
        reads.append((int(Path(self.path).stem[1:]), tensor))
        return read(self, tensor)

    monkeypatch.setattr(TensorFile, "__getitem__", recorded)
    loads: list[int] = []

    def counted(result: fedmq.ClientResult) -> fedmq.ClientResult:
        def load() -> Mapping[str, torch.Tensor]:
            loads.append(result.client)
            return result.load()
        return dataclasses.replace(result, loader=load)

    results = [counted(r) for r in client_results(store, 1, list(range(7)), CURRENT)]
    make_strategy(StrategySpec(name=name, options=options)).aggregate(CTX, CURRENT, results, [])
    assert loads == list(range(7)), "each client's weights opened once, in client order"
    # Tensor by tensor: the clients' reads of one tensor come together (a run), each client once
    # per run; reading client by client (dict(r.load())) would make runs of one read. Only
    # Krum's single pick is read alone, one client: one model.
    runs: list[list[int]] = []
    for i, (client, tensor) in enumerate(reads):
        if i == 0 or reads[i - 1][1] != tensor:
            runs.append([])
        runs[-1].append(client)
    assert runs and all(len(run) == len(set(run)) for run in runs), runs
    alone = {run[0] for run in runs if len(run) == 1}
    assert len(alone) <= (1 if name == "krum" else 0), runs


def test_a_robust_strategy_reads_real_spooled_updates_and_repeats_bit_for_bit(tmp_path: Path) -> None:
    weights = with_outliers(7, [1])
    store = spool(tmp_path, weights)
    for name in ("median", "trimmed_mean", "krum", "multi_krum", "bulyan"):
        strategy = make_strategy(StrategySpec(name=name))
        spooled = strategy.aggregate(CTX, CURRENT, client_results(store, 1, list(range(7)), CURRENT), [])
        again = strategy.aggregate(CTX, CURRENT, client_results(store, 1, list(range(7)), CURRENT), [])
        in_memory = strategy.aggregate(CTX, CURRENT, results_of(weights), [])
        for tensor in spooled.weights:
            assert torch.equal(spooled.weights[tensor], again.weights[tensor]), (name, tensor)
            assert torch.equal(spooled.weights[tensor], in_memory.weights[tensor]), (name, tensor)


@pytest.mark.parametrize(("name", "options", "k", "expected"), [
    ("krum", {"f": 3}, 7, "krum with f=3 needs at least 9 clients, got 7: lower f or select more clients"),
    ("multi_krum", {"f": 2}, 6, "krum with f=2 needs at least 7 clients, got 6"),
    ("multi_krum", {"f": 1, "m": 9}, 8, "krum selects m clients with 1 <= m <= 8 (the clients), got m=9"),
    ("bulyan", {"f": 3}, 10, "bulyan with f=3 needs at least 15 clients, got 10: lower f or select more"),
])
def test_too_few_clients_for_f_or_m_is_an_aggregation_error_saying_what_to_change(
    name: str, options: dict[str, Any], k: int, expected: str
) -> None:
    with pytest.raises(AggregationError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        run(name, client_weights(k), **options)


@pytest.mark.parametrize(("name", "options", "expected"), [
    ("trimmed_mean", {"beta": 0.5}, "strategy.options.beta: Input should be less than 0.5"),
    ("trimmed_mean", {"beta": -0.1}, "strategy.options.beta: Input should be greater than or equal to 0"),
    ("trimmed_mean", {"beta": "0.2"}, "strategy.options.beta: Input should be a valid number"),
    ("krum", {"f": -1}, "strategy.options.f: Input should be greater than or equal to 0"),
    ("krum", {"f": 1.5}, "strategy.options.f: Input should be a valid integer"),
    ("krum", {"m": 2}, "strategy.options.m: unknown option"),
    ("multi_krum", {"m": 0}, "strategy.options.m: Input should be greater than or equal to 1"),
    ("bulyan", {"f": True}, "strategy.options.f: Input should be a valid integer"),
    ("median", {"beta": 0.1}, "strategy.options.beta: unknown option"),
])
def test_bad_options_are_refused_naming_the_option_and_the_bound(
    name: str, options: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        strategy_options(name, options)
    assert expected in str(caught.value)
