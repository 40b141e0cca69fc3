"""What one job may take of the aggregator: a model over FEDMQ_MAX_MODEL_BYTES and a state over
FEDMQ_JOB_DISK_BYTES fail the job with the setting named; FEDMQ_KEEP_CHECKPOINTS prunes old
checkpoints but keeps the best round's, and a job stopped and resumed still ends as undisturbed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.settings import Settings
from fedmq.services.aggregator.limits import folder_bytes
from fedmq.services.aggregator.store import JobStore
from fedmq.services.cli.embedded import run_job
from tests.conftest import assert_bit_identical, small_job
from tests.integration.conftest import Transport
from tests.integration.test_pause import InterruptWhen

# The worst accuracy is the "best": round 0's or 1's, long before the last rounds.
OBJECTIVE = {"metric": "server.accuracy", "mode": "min"}


def with_settings(transport: Transport, **changes: Any) -> Settings:
    return Settings(**{**transport.settings.model_dump(), **changes})


def test_a_model_over_the_deployment_limit_fails_the_job_naming_the_setting(transport: Transport) -> None:
    settings = with_settings(transport, max_model_bytes=4096)  # the tiny MLP has 2410 floats: 9640 bytes
    result = run_job(small_job(), settings, connect=transport.connect, idle_timeout=60)
    assert result["status"] == "failed"
    assert "9640 bytes of tensors" in result["reason"] and "FEDMQ_MAX_MODEL_BYTES" in result["reason"]
    assert result["jobs_refused"] == {"model_bytes": 1}
    assert not (settings.state_dir / "aggregator" / result["job_id"]).exists(), "nothing was written"


def test_a_job_whose_state_outgrows_its_disk_quota_fails_before_writing_past_it(transport: Transport) -> None:
    quota = 80_000  # the initial checkpoint, round 1's 5 updates and its checkpoint fit; round 2's do not
    settings = with_settings(transport, job_disk_bytes=quota)
    result = run_job(small_job(rounds=5), settings, connect=transport.connect, idle_timeout=60)
    assert result["status"] == "failed"
    assert "FEDMQ_JOB_DISK_BYTES" in result["reason"] and f"over its quota ({quota}" in result["reason"]
    assert result["jobs_refused"] == {"disk_quota": 1}
    assert 0 < folder_bytes(settings.state_dir / "aggregator" / result["job_id"]) <= quota


def checkpoints(state: Path, job_id: str) -> set[str]:
    """The digests of the global weights the job's checkpoints hold (a file is `<weights>-<state>`)."""
    folder = state / "aggregator" / job_id / "checkpoints"
    return {p.stem.partition("-")[0] for p in folder.glob("*.safetensors")}


def test_old_checkpoints_are_pruned_but_the_best_and_the_last_are_kept(
    settings: Settings, tmp_path: Path
) -> None:
    spec = small_job(rounds=6, objective=OBJECTIVE)
    every = run_job(spec, Settings(state_dir=tmp_path / "every"), idle_timeout=60)
    assert len(checkpoints(tmp_path / "every", every["job_id"])) == 7, "0: every round's is kept"
    kept = Settings(**{**settings.model_dump(), "keep_checkpoints": 2})
    result = run_job(spec, kept, idle_timeout=60)
    assert result["status"] == "completed"
    digests = [h["model_digest"] for h in result["history"]]
    assert checkpoints(kept.state_dir, result["job_id"]) == {*digests[-2:], result["best"]["model_digest"]}
    assert result["best"] == every["best"] and result["best"]["round"] < 4, "the best is not among the last"
    best = result["best"]["model_digest"]
    assert_bit_identical(JobStore(kept.state_dir / "aggregator", result["job_id"]).load_weights(best),
                         JobStore(tmp_path / "every" / "aggregator", every["job_id"]).load_weights(best))
    assert_bit_identical(load_state(result["model_path"])[0], load_state(every["model_path"])[0])


@pytest.mark.parametrize("keep", [1, 2])
def test_a_job_stopped_and_resumed_with_few_checkpoints_kept_ends_as_undisturbed(
    keep: int, tmp_path: Path
) -> None:
    spec = small_job(rounds=5, clients__total=6, clients__per_round=3, round_timeout_s=600)
    undisturbed = run_job(spec, Settings(state_dir=tmp_path / "undisturbed"), idle_timeout=60)
    settings = Settings(state_dir=tmp_path / "stopped", keep_checkpoints=keep)
    with pytest.raises(KeyboardInterrupt):
        run_job(spec, settings, job_id="stopped", idle_timeout=60,
                interrupt=InterruptWhen(lambda job: job["round"] >= 3))
    assert len(checkpoints(settings.state_dir, "stopped")) <= keep + 1  # + the round still closing
    resumed = run_job(spec, settings, job_id="stopped", resume=True, idle_timeout=60)
    assert resumed["status"] == "completed", resumed.get("reason")
    assert_bit_identical(load_state(resumed["model_path"])[0], load_state(undisturbed["model_path"])[0])
    assert len(checkpoints(settings.state_dir, "stopped")) == keep
