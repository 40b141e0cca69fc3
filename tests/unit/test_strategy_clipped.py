"""The `clipped` wrapper: any strategy given clients' deltas clipped to a norm, everything else forwarded."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import StrategySpec
from fedmq.common.strategy.contract import (
    PROXIMAL_MU,
    Aggregate,
    ClientFailed,
    ClientResult,
    RoundContext,
    StateDict,
)
from fedmq.common.strategy.loading import make_strategy, strategy_options
from fedmq.services.aggregator.strategies.clipped import Clipped
from tests.support.strategies import Counting


def clipped(inner: Any, max_norm: float) -> Clipped:
    strategy = make_strategy(StrategySpec(name="clipped", options={"inner": inner, "max_norm": max_norm}))
    assert isinstance(strategy, Clipped)
    return strategy


def updates(seed: int, count: int, scales: Sequence[float]) -> list[StateDict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(5, 4, generator=gen, dtype=torch.float64) * s,
         "b": torch.randn(4, generator=gen) * s, "n": torch.tensor(3 * i)}
        for i, s in zip(range(count), scales, strict=True)
    ]


def zeros() -> StateDict:
    return {"w": torch.zeros(5, 4, dtype=torch.float64), "b": torch.zeros(4), "n": torch.tensor(0)}


def result(client: int, num_examples: int, weights: Mapping[str, torch.Tensor],
           extras: Mapping[str, torch.Tensor] | None = None) -> ClientResult:
    return ClientResult(client=client, num_examples=num_examples, loader=lambda: weights,
                        extras_loader=lambda: extras or {})


def run_round(
    strategy: Clipped, current: StateDict, weights: Sequence[Mapping[str, torch.Tensor]],
    server_round: int = 1, failures: Sequence[ClientFailed] = (),
) -> Aggregate:
    results = [result(i, 10 * (i + 1), w) for i, w in enumerate(weights)]
    ctx = RoundContext(round=server_round, rounds=5, seed=0, num_clients=10,
                       clients=tuple(r.client for r in results))
    return strategy.aggregate(ctx, current, results, failures)


def np_norm(state: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(np.sum((state[k].double().numpy() - current[k].double().numpy()) ** 2))
                         for k in ("w", "b")))


def test_fedavg_inside_averages_the_clients_deltas_scaled_to_at_most_the_bound() -> None:
    current = {"w": torch.full((5, 4), 0.5, dtype=torch.float64), "b": torch.full((4,), -1.0),
               "n": torch.tensor(0)}
    clients = [{k: v + current[k] if v.is_floating_point() else v for k, v in u.items()}
               for u in updates(1, 4, [0.1, 1.0, 10.0, 100.0])]
    bound = 2.0
    out = run_round(clipped("fedavg", bound), current, clients)
    norms = [np_norm(c, current) for c in clients]
    examples = [10, 20, 30, 40]
    for name in ("w", "b"):
        base = current[name].double().numpy()
        deltas = [(c[name].double().numpy() - base) * min(1.0, bound / n)
                  for c, n in zip(clients, norms, strict=True)]
        expected = base + np.average(deltas, axis=0, weights=examples)
        np.testing.assert_allclose(out.weights[name].double().numpy(), expected, rtol=1e-6, atol=1e-6)
    assert out.weights["n"].item() == round(np.average([0, 3, 6, 9], weights=examples)), "integers unclipped"
    assert out.metrics["clip_clients_clipped"] == float(sum(n > bound for n in norms)) == 3.0
    assert out.metrics["clip_norm_max"] == pytest.approx(max(norms), rel=1e-12)
    assert out.metrics["clip_norm_mean"] == pytest.approx(sum(norms) / 4, rel=1e-12)


@pytest.mark.parametrize("scale", [3.0, 100.0, 1e6])
def test_a_scaled_clients_delta_reaches_the_inner_strategy_within_the_bound(scale: float) -> None:
    current = {"w": torch.full((5, 4), 0.25, dtype=torch.float64), "b": torch.zeros(4), "n": torch.tensor(0)}
    for seed in range(10):
        (update,) = updates(seed, 1, [scale])
        client = {k: v + current[k] if v.is_floating_point() else v for k, v in update.items()}
        out = run_round(clipped("fedavg", 1.0), current, [client])
        moved = np_norm(out.weights, current)
        assert moved <= 1.0 + 4 * torch.finfo(torch.float32).eps  # float32 "b" rounds to its dtype
        assert moved == pytest.approx(1.0, rel=1e-6)


def test_clients_within_the_bound_reach_the_inner_strategy_untouched() -> None:
    current = zeros()
    clients = updates(2, 3, [0.01, 0.01, 0.01])
    inside = run_round(clipped("fedavg", 10.0), current, clients)
    plain = make_strategy(StrategySpec(name="fedavg")).aggregate(
        RoundContext(round=1, rounds=5, seed=0, num_clients=10), current,
        [result(i, 10 * (i + 1), w) for i, w in enumerate(clients)],
        [],
    )
    assert all(torch.equal(inside.weights[k], plain.weights[k]) for k in current)
    assert inside.metrics["clip_clients_clipped"] == 0.0


def test_the_inner_strategys_state_metrics_and_config_are_forwarded() -> None:
    wrapped = clipped({"name": "fedadam", "options": {"eta": 0.1}}, 1.0)
    current = zeros()
    clients = updates(3, 3, [1.0, 2.0, 0.5])
    out = run_round(wrapped, current, clients)
    assert set(out.metrics) >= {"pseudo_gradient_norm", "server_step_norm", "clip_clients_clipped"}
    assert wrapped.state().keys() == {"m.w", "m.b", "v.w", "v.b"}, "the inner FedAdam's moments"
    restored = clipped({"name": "fedadam", "options": {"eta": 0.1}}, 1.0)
    restored.load_state(wrapped.state())
    after = [run_round(s, dict(out.weights), clients, server_round=2) for s in (wrapped, restored)]
    assert all(torch.equal(after[0].weights[k], after[1].weights[k]) for k in current), "moments restored"
    fresh = run_round(clipped({"name": "fedadam", "options": {"eta": 0.1}}, 1.0), dict(out.weights),
                      clients, server_round=2)
    assert not torch.equal(fresh.weights["w"], after[0].weights["w"]), "the restore test can fail"
    prox = clipped({"name": "fedprox", "options": {"mu": 0.3}}, 1.0)
    assert prox.configure(RoundContext(round=2, rounds=5, seed=0, num_clients=10)) == {PROXIMAL_MU: 0.3}


def test_a_users_strategy_inside_keeps_its_client_state_and_extras() -> None:
    wrapped = clipped({"name": "tests.support.strategies:Counting", "options": {"scale": 2.0}}, 1.0)
    assert isinstance(wrapped.inner, Counting)
    assert wrapped.sends_client_state is True and wrapped.expected_extras == frozenset({"count"})
    assert clipped("fedavg", 1.0).sends_client_state is False
    current = zeros()
    results = [
        result(c, 5, u, {"count": torch.ones(1) * (c + 1)})
        for c, u in zip((2, 7), updates(4, 2, [5.0, 5.0]), strict=True)
    ]
    ctx = RoundContext(round=1, rounds=5, seed=0, num_clients=10, clients=(2, 7))
    out = wrapped.aggregate(ctx, current, results, [ClientFailed(client=4, reason="oom", phase="train")])
    assert sorted(out.client_state) == [2, 7]
    assert out.metrics["failed"] == 1.0 and out.metrics["clip_clients_clipped"] == 2.0
    assert "server_rounds" in out.metrics and wrapped.state().keys() == wrapped.inner.state().keys()


def test_the_inner_spec_is_checked_like_a_jobs_strategy() -> None:
    with pytest.raises(ConfigError, match=r"inner strategy 'fedavgm': invalid options[\s\S]*"
                       r"strategy.options.inner.options.server_lr: Input should be greater than 0"):
        strategy_options("clipped", {"inner": {"name": "fedavgm", "options": {"server_lr": -1.0}}})
    with pytest.raises(ConfigError, match="unknown strategy 'fedadm'; did you mean 'fedadam'"):
        strategy_options("clipped", {"inner": {"name": "fedadm"}})
    with pytest.raises(ConfigError, match="max_norm: Input should be greater than 0"):
        strategy_options("clipped", {"inner": "fedavg", "max_norm": 0.0})
    with pytest.raises(ConfigError, match="clip_norm: unknown option"):
        strategy_options("clipped", {"clip_norm": 1.0})
    nested = clipped({"name": "clipped", "options": {"inner": "fedavg", "max_norm": 0.5}}, 2.0)
    assert isinstance(nested.inner, Clipped) and nested.inner.options.max_norm == 0.5


def test_the_inner_strategy_reads_clipped_tensors_one_at_a_time() -> None:
    """A robust inner strategy looks tensors up one by one: the wrapper never builds a whole model."""
    looked_up: list[str] = []

    class Recording(dict[str, torch.Tensor]):
        def __getitem__(self, name: str) -> torch.Tensor:
            looked_up.append(name)
            return super().__getitem__(name)

    current = zeros()
    client = Recording(updates(5, 1, [50.0])[0])
    strategy = clipped("fedavg", 1.0)
    results = [ClientResult(client=0, num_examples=1, loader=lambda: client)]
    ctx = RoundContext(round=1, rounds=5, seed=0, num_clients=10, clients=(0,))
    seen = []

    class Inner(type(strategy.inner)):  # type: ignore[misc]
        def aggregate(self, ctx: Any, current: Any, results: Any, failures: Any) -> Aggregate:
            loaded = results[0].load()
            seen.append((type(loaded).__name__, len(looked_up)))
            return super().aggregate(ctx, current, results, failures)

    strategy.inner = Inner()
    strategy.aggregate(ctx, current, results, [])
    assert seen == [("ClippedWeights", 2)], "the norm pass read w and b; loading read nothing yet"
