"""A DDP job in one process (`fedmq run examples/ddp.yaml`): two learner threads, a rank each."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.ddp import reference_weights
from fedmq.common.checkpoint import load_model, load_state
from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import load_job
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import REPO


def test_fedmq_run_trains_the_ddp_example_to_the_one_process_weights(tmp_path: Path) -> None:
    spec = load_job(REPO / "examples" / "ddp.yaml")
    assert spec.ddp is not None
    spec = spec.with_changes(ddp={**spec.ddp.model_dump(), "master_port": 29517})
    result = run_job(spec, Settings(state_dir=tmp_path / "state"))
    assert result["status"] == "completed", result
    weights = load_state(result["model_path"])[0]
    reference = reference_weights({"epochs": 3}, world_size=2)  # examples/ddp.yaml's options
    assert max(float((weights[k] - reference[k]).abs().max()) for k in reference) < 1e-6
    with pytest.raises(ConfigError, match="DDP job's model"):  # no Task to build it: said so
        load_model(result["model_path"])
