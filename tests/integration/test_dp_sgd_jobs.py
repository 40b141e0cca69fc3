"""Jobs with `train.dp_sgd` (local DP-SGD) through the services, on either bus, fused or not.

The noise comes from each client's secret stream (the learners' FEDMQ_DP_KEY; tests/conftest.py
sets one), so a DP-SGD job is bit-reproducible like any other: on RabbitMQ with three learners as
in one process, and, fused, however its clients are grouped. Each round reports
`train.dp_epsilon`, the largest ε over its clients.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import SecretStr

from fedmq.common.checkpoint import load_state
from fedmq.common.errors import ConfigError
from fedmq.common.settings import Settings
from fedmq.common.task.contract import DpSgd
from fedmq.common.task.dpsgd import EPSILON, epsilon_spent
from fedmq.services.cli.embedded import run_job
from tests.conftest import assert_bit_identical, shard_size, small_job
from tests.integration.conftest import Transport

DP = {"clip_norm": 1.0, "noise_multiplier": 1.1, "delta": 1e-4}
PRIVATE = small_job(clients__total=6, rounds=3, train__dp_sgd=DP)


@pytest.mark.slow  # 11 s in memory; tests/unit/test_dpsgd.py covers DP-SGD in the 2-minute tier
def test_a_dp_sgd_job_is_bit_identical_on_either_bus_and_reports_its_weakest_client_s_epsilon(
    transport: Transport, tmp_path: Path
) -> None:
    alone = run_job(PRIVATE, Settings(state_dir=tmp_path / "alone"), idle_timeout=60)
    assert alone["status"] == "completed", alone.get("reason")
    spread = run_job(PRIVATE, transport.settings, learners=3, connect=transport.connect, idle_timeout=60)
    assert spread["status"] == "completed", spread.get("reason")
    weights = load_state(spread["model_path"])[0]
    assert_bit_identical(weights, load_state(alone["model_path"])[0])

    dp = DpSgd(**DP)
    sizes = [shard_size(PRIVATE, client) for client in range(6)]
    for record in spread["history"][1:]:
        expected = max(
            epsilon_spent(dp, 32, n, math.ceil(n / 32), record["round"])[EPSILON] for n in sizes
        )
        assert record["metrics"]["train"][EPSILON] == pytest.approx(expected, rel=1e-9)

    plain = run_job(small_job(clients__total=6, rounds=3), Settings(state_dir=tmp_path / "plain"),
                    idle_timeout=60)
    gaps = [float((weights[n] - w).abs().max()) for n, w in load_state(plain["model_path"])[0].items()]
    assert max(gaps) > 1e-3, "clipping and noise changed the training"


@pytest.mark.slow  # three jobs: `make test`, not the broker-free tier
def test_a_fused_dp_sgd_job_is_bit_identical_however_grouped_and_close_to_one_at_a_time(
    tmp_path: Path,
) -> None:
    fused = small_job(clients__total=6, rounds=3, train__dp_sgd=DP, train__fuse=True)
    together = run_job(fused, Settings(state_dir=tmp_path / "together"), idle_timeout=60)
    assert together["status"] == "completed", together.get("reason")
    assert together["fused_groups"] == [6, 6, 6]
    pairs = run_job(fused, Settings(state_dir=tmp_path / "pairs", fuse_clients=2), learners=3,
                    idle_timeout=60)
    assert pairs["status"] == "completed", pairs.get("reason")
    weights = load_state(together["model_path"])[0]
    assert_bit_identical(load_state(pairs["model_path"])[0], weights)

    sequential = run_job(PRIVATE, Settings(state_dir=tmp_path / "sequential"), idle_timeout=60)
    gaps = [float((weights[n] - w).abs().max()) for n, w in load_state(sequential["model_path"])[0].items()]
    assert max(gaps) < 1e-4, f"fused DP-SGD is {max(gaps):.2e} from sequential"
    assert [h["metrics"]["train"][EPSILON] for h in together["history"][1:]] == pytest.approx(
        [h["metrics"]["train"][EPSILON] for h in sequential["history"][1:]], rel=1e-12)


@pytest.mark.slow  # five jobs: `make test`, not the broker-free tier
def test_the_noise_comes_from_the_learners_key_and_without_one_from_a_random_key(tmp_path: Path) -> None:
    def weights(name: str, key: str | None) -> dict:
        settings = Settings(state_dir=tmp_path / name, dp_key=None if key is None else SecretStr(key))
        result = run_job(small_job(clients__total=3, rounds=1, train__dp_sgd=DP), settings, idle_timeout=60)
        assert result["status"] == "completed", result.get("reason")
        return load_state(result["model_path"])[0]

    first = weights("a", "one secret")
    assert_bit_identical(weights("b", "one secret"), first)
    assert any(not torch.equal(first[n], w) for n, w in weights("c", "another secret").items()), (
        "the key, not the job's public seed, decides the noise")
    fresh = zip(weights("d", None).values(), weights("e", None).values(), strict=True)
    assert any(not torch.equal(a, b) for a, b in fresh), "no key: a fresh one each run"


def test_a_task_with_its_own_train_cannot_ask_for_dp_sgd_before_anything_is_published() -> None:
    from fedmq.common.allowlist import AllowList
    from fedmq.services.cli.app import check_task

    spec = small_job(task__name="tests.integration.train_plugins:Broken", train__dp_sgd=DP)
    with pytest.raises(ConfigError, match="defines its own train\\(\\), and train.dp_sgd is fedmq's loop's"):
        check_task(spec, AllowList.project(("tests.",), spec_dir=None))
