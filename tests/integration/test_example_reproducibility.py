"""Every example gives the same weights, bit for bit, with 1 learner in memory or 3 learners on
either bus (updates arrive in other orders; the result must not care)."""

from __future__ import annotations

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import JobSpec, load_job
from fedmq.services.cli.embedded import run_job
from tests.conftest import REPO, EmbeddedRuns, assert_bit_identical
from tests.integration.conftest import Transport

SLOW = pytest.mark.slow  # 6 s each in memory: kept out of the 2-minute tier
EXAMPLES = ["digits", "digits-dp", "regression",
            *(pytest.param(name, marks=SLOW) for name in ("gan", "charlm"))]


def short(name: str) -> JobSpec:
    spec = load_job(REPO / "examples" / f"{name}.yaml")
    return spec.with_changes(
        rounds=2, clients={"total": min(spec.clients.total, 6), "per_round": None, "min_fit": None}
    )


@pytest.mark.parametrize("name", EXAMPLES)
def test_three_learners_on_either_bus_give_one_learners_weights(
    name: str, transport: Transport, embedded_runs: EmbeddedRuns
) -> None:
    spec = short(name)
    result = run_job(spec, transport.settings, learners=3, connect=transport.connect, idle_timeout=120)
    assert result["status"] == "completed", result.get("reason")
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))
