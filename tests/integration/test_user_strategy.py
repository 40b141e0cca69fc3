"""A user's strategy from an entrypoint, end to end on the in-memory bus; and FedProx."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedmq.common.checkpoint import load_state
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from fedmq.services.scheduler.sampling import sample_clients
from tests.conftest import REPO, assert_bit_identical, shard_size, small_job
from tests.integration import train_plugins
from tests.integration.test_pause import InterruptWhen
from tests.support import strategies

COUNTING = {
    "task__name": "tests.support.strategies:CountingDigits",
    "strategy": {"name": "tests.support.strategies:Counting", "options": {"scale": 1.0}},
    "clients__total": 5,
    "clients__per_round": 3,
    "rounds": 4,
    "objective": {"metric": "strategy.max_count", "mode": "max"},
}


def strategy_metrics(result: dict[str, Any]) -> list[dict[str, float]]:
    return [h["metrics"]["strategy"] for h in result["history"] if h["round"] > 0]


def test_a_users_strategy_carries_client_state_and_extras_both_ways_and_reports_its_metrics(
    settings: Settings,
) -> None:
    spec = small_job(**COUNTING)
    result = run_job(spec, settings, idle_timeout=60)
    assert result["status"] == "completed", result.get("reason")
    samples = [sample_clients(spec.seed, r, 5, 3) for r in range(1, spec.rounds + 1)]
    metrics = strategy_metrics(result)
    assert [m["max_count"] for m in metrics] == strategies.expected_counts(samples)
    assert [m["mismatched"] for m in metrics] == [0.0] * spec.rounds, "the learner got the stored count"
    assert [m["server_rounds"] for m in metrics] == [1.0, 2.0, 3.0, 4.0]
    assert "strategy" not in result["history"][0]["metrics"], "round 0 is the initial model"
    assert result["final"]["strategy.max_count"] == metrics[-1]["max_count"]


def test_a_users_strategy_options_reach_it(settings: Settings) -> None:
    spec = small_job(**{**COUNTING, "strategy": {"name": "tests.support.strategies:Counting",
                                                 "options": {"scale": 10.0}}, "rounds": 1})
    result = run_job(spec, settings, idle_timeout=60)
    assert strategy_metrics(result)[0]["max_count"] == 10.0


def test_a_job_with_a_users_strategy_stopped_and_resumed_ends_as_an_undisturbed_run(
    settings: Settings, tmp_path: Any
) -> None:
    spec = small_job(**{**COUNTING, "rounds": 5, "round_timeout_s": 600})
    undisturbed = run_job(spec, Settings(state_dir=tmp_path / "undisturbed"), idle_timeout=60)
    with pytest.raises(KeyboardInterrupt):
        run_job(spec, settings, job_id="counting", idle_timeout=60,
                interrupt=InterruptWhen(lambda job: job["round"] >= 3))
    resumed = run_job(spec, settings, job_id="counting", resume=True, idle_timeout=60)
    assert resumed["status"] == "completed"
    assert strategy_metrics(resumed) == strategy_metrics(undisturbed)
    assert_bit_identical(load_state(resumed["model_path"])[0], load_state(undisturbed["model_path"])[0])
    clients = settings.state_dir / "aggregator" / "counting" / "clients"
    kept = sorted(p.relative_to(clients).as_posix() for p in clients.rglob("*.safetensors"))
    assert len(kept) == len({p.split("/")[0] for p in kept}), f"one version per client after prune: {kept}"


def test_fedprox_with_mu_zero_is_fedavg_bit_for_bit_and_mu_above_zero_is_not(
    settings: Settings, tmp_path: Any
) -> None:
    fedavg = run_job(small_job(rounds=2), settings, idle_timeout=60)
    zero = run_job(small_job(rounds=2, strategy={"name": "fedprox", "options": {"mu": 0.0}}),
                   Settings(state_dir=tmp_path / "zero"), idle_timeout=60)
    prox = run_job(small_job(rounds=2, strategy={"name": "fedprox", "options": {"mu": 1.0}}),
                   Settings(state_dir=tmp_path / "prox"), idle_timeout=60)
    assert_bit_identical(load_state(zero["model_path"])[0], load_state(fedavg["model_path"])[0])
    a, b = load_state(prox["model_path"])[0], load_state(fedavg["model_path"])[0]
    assert any(not torch.equal(a[k], b[k]) for k in a), "the proximal term changed training"
    assert prox["final"]["server.accuracy"] > prox["initial"]["server.accuracy"]


def test_a_task_with_its_own_train_gets_fedproxs_mu_and_the_global_weights(settings: Settings) -> None:
    strategies.PROX_SEEN.clear()
    spec = small_job(rounds=2, task__name="tests.support.strategies:ProxRecording",
                     strategy={"name": "fedprox", "options": {"mu": 0.25}})
    assert run_job(spec, settings, idle_timeout=60)["status"] == "completed"
    assert sorted(set(strategies.PROX_SEEN)) == [(1, 0.25, True), (2, 0.25, True)]


def test_a_users_strategy_raising_fails_the_job_naming_the_strategy_phase_and_round(
    settings: Settings,
) -> None:
    spec = small_job(rounds=3, strategy="tests.support.strategies:FailsInRound2")
    result = run_job(spec, settings, idle_timeout=60)
    assert result["status"] == "failed"
    assert "user code failed in aggregator strategy.aggregate (round 2)" in result["reason"]
    assert "ZeroDivisionError: the user's bug" in result["reason"]
    assert [h["round"] for h in result["history"]] == [0, 1]


def test_the_docs_strategy_example_runs_a_job(
    settings: Settings, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = (REPO / "docs" / "strategies.md").read_text()
    start = page.index("import fedmq\n\nclass ClippedMean")
    (tmp_path / "docs_strategy.py").write_text(page[start:page.index("```", start)])
    monkeypatch.syspath_prepend(str(tmp_path))
    allowed = Settings(**{**settings.model_dump(), "allowed_code": "docs_strategy"})  # as the docs say
    result = run_job(small_job(rounds=2, strategy="docs_strategy:ClippedMean"), allowed, idle_timeout=60)
    assert result["status"] == "completed", result.get("reason")
    assert strategy_metrics(result) == [{"failed": 0.0}, {"failed": 0.0}]
    assert result["final"]["server.accuracy"] > result["initial"]["server.accuracy"]


def test_a_strategy_sees_which_client_failed_why_and_in_which_phase(settings: Settings) -> None:
    spec = small_job(
        clients__min_fit=4, clients__on_error="drop_client", rounds=2,
        task__name="tests.integration.train_plugins:Failing",
        strategy="tests.support.strategies:SeesFailures",
    )
    train_plugins.FAIL_SIZE[0] = shard_size(spec, 0)
    try:
        result = run_job(spec, settings, idle_timeout=60)
    finally:
        train_plugins.FAIL_SIZE[0] = -1
    assert result["status"] == "completed"
    assert strategy_metrics(result) == [{"failed": 1.0, "failed_in_train": 1.0, "failed_client": 0.0}] * 2
