"""DP-FedAvg through the strategy: Opacus's epsilon (also after a restore), bounded updates, noise."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch

from fedmq.common.errors import AggregationError, ConfigError
from fedmq.common.jobspec import StrategySpec
from fedmq.common.strategy.contract import Aggregate, ClientFailed, ClientResult, RoundContext, StateDict
from fedmq.common.strategy.loading import make_strategy, strategy_options
from fedmq.services.aggregator.strategies.dp import DPFedAvg
from tests.unit.test_privacy import opacus_epsilon

TOTAL = 20


def dp(name: str = "dp_fedavg", **options: float | bool) -> DPFedAvg:
    strategy = make_strategy(StrategySpec(name=name, options=options))
    assert isinstance(strategy, DPFedAvg)
    return strategy


def client_weights(seed: int, clients: int, scale: float = 1.0) -> list[StateDict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(6, 5, generator=gen, dtype=torch.float64) * scale,
         "b": torch.randn(5, generator=gen), "steps": torch.tensor(c)}
        for c in range(clients)
    ]


def result(client: int, num_examples: int, weights: Mapping[str, torch.Tensor],
           extras: Mapping[str, torch.Tensor] | None = None) -> ClientResult:
    return ClientResult(client=client, num_examples=num_examples, loader=lambda: weights,
                        extras_loader=lambda: extras or {})


def run_round(
    strategy: DPFedAvg, server_round: int, current: StateDict, updates: Sequence[StateDict], failed: int = 0
) -> Aggregate:
    results = [result(i, 10 + i, u) for i, u in enumerate(updates)]
    failures = [ClientFailed(client=len(updates) + i, reason="gone", phase="timeout") for i in range(failed)]
    ctx = RoundContext(round=server_round, rounds=50, seed=11, num_clients=TOTAL,
                       clients=tuple(r.client for r in results))
    return strategy.aggregate(ctx, current, results, failures)


def zeros() -> StateDict:
    return {"w": torch.zeros(6, 5, dtype=torch.float64), "b": torch.zeros(5), "steps": torch.tensor(0)}


# --- privacy accounting ----------------------------------------------------------------------


@pytest.mark.slow  # 4-5 s each: kept out of the 2-minute tier
@pytest.mark.parametrize("name", ["dp_fedavg", "dp_fedavg_adaptive"])
def test_the_reported_epsilon_is_opacus_rdp_accountants_every_round_and_after_a_restore(name: str) -> None:
    z, delta = 1.1, 1e-4
    q = 6 / TOTAL  # 5 clients reported and 1 failed: 6 sampled
    strategy, weights = dp(name, noise_multiplier=z, delta=delta), zeros()
    for r in range(1, 5):
        out = run_round(strategy, r, weights, client_weights(r, 5), failed=1)
        weights = dict(out.weights)
        assert out.metrics["epsilon"] == pytest.approx(opacus_epsilon(z, q, r, delta), rel=1e-9)
    restored = dp(name, noise_multiplier=z, delta=delta)
    restored.load_state({k: v.clone() for k, v in strategy.state().items()})
    later = [run_round(s, 5, weights, client_weights(5, 5), failed=1) for s in (strategy, restored)]
    assert later[1].metrics["epsilon"] == pytest.approx(opacus_epsilon(z, q, 5, delta), rel=1e-9)
    assert later[1].metrics == later[0].metrics
    assert all(torch.equal(later[0].weights[k], later[1].weights[k]) for k in weights), "same noise"
    assert opacus_epsilon(z, q, 5, delta) > opacus_epsilon(z, q, 4, delta), "epsilon grows: the test can fail"


def test_a_fresh_strategy_given_no_state_counts_from_round_one() -> None:
    strategy = dp(noise_multiplier=2.0)
    strategy.load_state({})
    out = run_round(strategy, 1, zeros(), client_weights(0, 4))
    assert out.metrics["epsilon"] == pytest.approx(opacus_epsilon(2.0, 4 / TOTAL, 1, 1e-5), rel=1e-9)


def test_no_noise_reports_no_epsilon_and_adds_nothing() -> None:
    updates = client_weights(1, 3, scale=1e-3)
    out = run_round(dp(noise_multiplier=0.0, clip_norm=10.0), 1, zeros(), updates)
    assert "epsilon" not in out.metrics
    expected = torch.stack([u["w"] for u in updates]).mean(0)
    torch.testing.assert_close(out.weights["w"], expected, rtol=1e-12, atol=1e-15)


def test_a_changed_sampling_rate_is_an_error_not_a_wrong_epsilon() -> None:
    strategy = dp()
    run_round(strategy, 1, zeros(), client_weights(1, 5))
    with pytest.raises(AggregationError, match="one sampling rate"):
        run_round(strategy, 2, zeros(), client_weights(2, 4))


# --- clipping --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dp_fedavg", "dp_fedavg_adaptive"])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 100.0, 1e6])
def test_a_clipped_clients_delta_never_exceeds_the_bound(name: str, scale: float) -> None:
    """One client and no noise: the new weights minus the current ones are that client's clipped delta."""
    bound = 0.5
    current = {"w": torch.full((6, 5), 3.0, dtype=torch.float64), "b": torch.full((5,), -2.0),
               "steps": torch.tensor(0)}
    for seed in range(20):
        (update,) = client_weights(seed, 1, scale)
        update = {k: v + current[k] if v.is_floating_point() else v for k, v in update.items()}
        strategy = dp(name, clip_norm=bound, noise_multiplier=0.0, report_client_stats=True)
        out = run_round(strategy, 1, current, [update])
        moved = math.sqrt(sum(float((out.weights[k].double() - current[k].double()).square().sum())
                              for k in ("w", "b")))
        raw = math.sqrt(sum(float((update[k].double() - current[k].double()).square().sum())
                            for k in ("w", "b")))
        assert out.metrics["dp_norm_max"] == pytest.approx(raw, rel=1e-12)
        # float32 "b" rounds w + Δ to its dtype: a few ulps of |w| = 2 over 5 values, never more.
        assert moved <= bound + 5 * 2.0 * torch.finfo(torch.float32).eps
        assert moved == pytest.approx(min(raw, bound), rel=1e-5)
        assert out.metrics["dp_clipped"] == float(raw > bound)
        assert torch.equal(out.weights["steps"], current["steps"]), "integer buffers are not released"


def test_the_clip_metrics_count_and_measure_the_round() -> None:
    current = zeros()
    updates = client_weights(4, 6)
    norms = [math.sqrt(float(u["w"].square().sum()) + float(u["b"].double().square().sum())) for u in updates]
    bound = float(np.median(norms))
    out = run_round(dp(clip_norm=bound, noise_multiplier=0.5, report_client_stats=True), 1, current, updates)
    assert out.metrics["dp_clients"] == 6.0
    assert out.metrics["dp_clipped"] == float(sum(n > bound for n in norms))
    assert out.metrics["dp_norm_mean"] == pytest.approx(sum(norms) / 6, rel=1e-9)
    assert out.metrics["dp_norm_max"] == pytest.approx(max(norms), rel=1e-9)
    assert out.metrics["dp_clip_norm"] == bound and out.metrics["dp_noise_multiplier"] == 0.5


@pytest.mark.parametrize("name", ["dp_fedavg", "dp_fedavg_adaptive"])
def test_raw_client_statistics_outside_epsilon_are_reported_only_when_asked(name: str) -> None:
    updates = client_weights(4, 6)
    out = run_round(dp(name, clip_norm=0.1, noise_multiplier=0.5), 1, zeros(), updates)
    assert not {"dp_clipped", "dp_norm_mean", "dp_norm_max"} & set(out.metrics)
    assert {"epsilon", "dp_clip_norm", "dp_noise_multiplier"} <= set(out.metrics)


# --- noise -----------------------------------------------------------------------------------


def test_the_noise_has_std_z_times_c_over_m_and_is_the_same_in_every_run() -> None:
    z, bound, m = 0.8, 2.0, 4
    current = {"w": torch.zeros(200, 500, dtype=torch.float64)}
    updates = [dict(current) for _ in range(m)]
    runs = [run_round(dp(clip_norm=bound, noise_multiplier=z), 1, current, updates) for _ in range(2)]
    noise = runs[0].weights["w"]
    assert float(noise.std()) == pytest.approx(z * bound / m, rel=0.01)
    assert torch.equal(noise, runs[1].weights["w"]), "noise only from ctx.generator: reproducible"
    other = run_round(dp(clip_norm=bound, noise_multiplier=z), 2, current, updates)
    assert not torch.equal(noise, other.weights["w"]), "each round draws its own noise"


# --- adaptive clipping -----------------------------------------------------------------------


def test_the_adaptive_bound_moves_geometrically_towards_the_quantile_and_persists() -> None:
    eta_c, gamma, c0 = 0.2, 0.5, 0.01
    options = {"clip_norm": c0, "noise_multiplier": 0.0, "count_noise_std": 0.0,
               "target_quantile": gamma, "clip_learning_rate": eta_c}
    strategy, weights = dp("dp_fedavg_adaptive", **options), zeros()
    bound = c0
    for r in range(1, 4):
        out = run_round(strategy, r, weights, client_weights(r, 5))  # norms ~5: all clipped, b̄ = 0
        assert out.metrics["dp_clip_norm"] == pytest.approx(bound, rel=1e-12)
        bound *= math.exp(-eta_c * (0 - gamma))
        assert out.metrics["dp_clip_norm_next"] == pytest.approx(bound, rel=1e-12)
    restored = dp("dp_fedavg_adaptive", **options)
    restored.load_state(strategy.state())
    assert float(restored.state()["dp.clip_norm"]) == pytest.approx(bound, rel=1e-15)
    after = run_round(restored, 4, weights, client_weights(4, 5))
    assert after.metrics["dp_clip_norm"] == pytest.approx(bound, rel=1e-15)
    unrestored = run_round(dp("dp_fedavg_adaptive", **options), 4, weights, client_weights(4, 5))
    assert unrestored.metrics["dp_clip_norm"] == c0, "without the state the bound starts over"


def test_adaptive_clipping_noises_the_update_with_z_delta_and_accounts_for_z() -> None:
    z, sigma_b = 1.0, 2.0
    out = run_round(dp("dp_fedavg_adaptive", noise_multiplier=z, count_noise_std=sigma_b), 1, zeros(),
                    client_weights(0, 5))
    assert out.metrics["dp_noise_multiplier"] == pytest.approx((z**-2 - (2 * sigma_b) ** -2) ** -0.5)
    assert out.metrics["epsilon"] == pytest.approx(opacus_epsilon(z, 5 / TOTAL, 1, 1e-5), rel=1e-9)


# --- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("dp_fedavg", {"clip_norm": 0.0}, "clip_norm: Input should be greater than 0"),
        ("dp_fedavg", {"noise_multiplier": -1.0}, "noise_multiplier: Input should be greater than or equal"),
        ("dp_fedavg", {"delta": 1.0}, "delta: Input should be less than 1"),
        ("dp_fedavg", {"target_quantile": 0.5}, "target_quantile: unknown option"),
        ("dp_fedavg_adaptive", {"target_quantile": 1.5}, "target_quantile: Input should be less than or"),
        ("dp_fedavg_adaptive", {"noise_multiplier": 2.0, "count_noise_std": 1.0},
         r"\(options\): Value error, count_noise_std must exceed noise_multiplier/2 = 1.0"),
    ],
)
def test_bad_options_are_refused_naming_the_option(name: str, options: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"strategy.options.{expected}"):
        strategy_options(name, options)
