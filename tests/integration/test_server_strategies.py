"""FedOpt, DP-FedAvg and the clipped wrapper in whole embedded jobs: stopped and resumed, as undisturbed.

Their server state (moments, rounds accounted, the adaptive bound) goes through the checkpoint,
so the resumed run's weights and strategy metrics (epsilon included) are the undisturbed run's.
"""

from __future__ import annotations

from typing import Any

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.privacy import epsilon
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import assert_bit_identical, small_job
from tests.integration.test_pause import InterruptWhen

STRATEGIES = {
    "fedyogi": {"name": "fedyogi", "options": {"eta": 0.02}},
    "dp_fedavg_adaptive": {"name": "dp_fedavg_adaptive",
                           "options": {"clip_norm": 0.2, "noise_multiplier": 0.3, "count_noise_std": 0.5}},
    "clipped": {"name": "clipped", "options": {"inner": {"name": "fedadam"}, "max_norm": 0.5}},
}


def strategy_metrics(result: dict[str, Any]) -> list[dict[str, float]]:
    return [h["metrics"]["strategy"] for h in result["history"] if h["round"] > 0]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_job_stopped_and_resumed_ends_with_the_undisturbed_weights_and_strategy_metrics(
    name: str, settings: Settings, tmp_path: Any
) -> None:
    spec = small_job(strategy=STRATEGIES[name], rounds=4, clients__total=6, clients__per_round=3,
                     round_timeout_s=600)
    undisturbed = run_job(spec, Settings(state_dir=tmp_path / "undisturbed"), idle_timeout=60)
    assert undisturbed["status"] == "completed", undisturbed.get("reason")
    with pytest.raises(KeyboardInterrupt):
        run_job(spec, settings, job_id="stopped", idle_timeout=60,
                interrupt=InterruptWhen(lambda job: job["round"] >= 2))
    resumed = run_job(spec, settings, job_id="stopped", resume=True, idle_timeout=60)
    assert resumed["status"] == "completed", resumed.get("reason")
    assert strategy_metrics(resumed) == strategy_metrics(undisturbed)
    assert_bit_identical(load_state(resumed["model_path"])[0], load_state(undisturbed["model_path"])[0])
    if name.startswith("dp_"):
        expected = [epsilon(0.3, 3 / 6, r, 1e-5) for r in range(1, 5)]
        assert [m["epsilon"] for m in strategy_metrics(resumed)] == pytest.approx(expected, rel=1e-9)
