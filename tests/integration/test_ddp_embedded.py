"""A DDP job in one process (`fedmq run examples/ddp.yaml`): two learner threads, a rank each."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.ddp import reference_weights
from fedmq.common.checkpoint import load_model, load_state
from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import load_job
from fedmq.common.messages import JobEvent
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import REPO


@pytest.mark.slow  # rank processes, epochs 0.6 s apart: ~35 s, most of `make test-fast` alone
def test_fedmq_run_trains_the_ddp_example_to_the_one_process_weights(tmp_path: Path) -> None:
    spec = load_job(REPO / "examples" / "ddp.yaml")
    assert spec.ddp is not None
    options = {**spec.ddp.options, "epoch_pause_s": 0.6}  # epochs apart: their reports stream apart
    spec = spec.with_changes(ddp={**spec.ddp.model_dump(), "master_port": 29517, "options": options})
    events: list[JobEvent] = []
    result = run_job(spec, Settings(state_dir=tmp_path / "state"), on_event=events.append)
    assert result["status"] == "completed", result
    # What the entry printed (every rank) and reported (rank 0) came to the watcher as it ran.
    progress = [e.data for e in events if e.kind == "progress"]
    printed = [line for d in progress if d["rank"] == 0 for line in d["lines"]]
    reports = [r for d in progress for r in d["reports"]]
    assert [r["step"] for r in reports] == [1, 2, 3] and {r["total"] for r in reports} == {3}
    assert [line for line in printed if line.startswith("epoch ")] == [
        f"epoch {r['step']}/3 loss {r['metrics']['loss']:.4f}" for r in reports
    ]
    assert len([d for d in progress if d["reports"]]) >= 2, "reports came only with the rank's exit"
    assert result["history"][-1]["reports"] == reports
    assert result["final"] == {"train.loss": reports[-1]["metrics"]["loss"]}
    weights = load_state(result["model_path"])[0]
    reference = reference_weights({"epochs": 3}, world_size=2)  # examples/ddp.yaml's options
    assert max(float((weights[k] - reference[k]).abs().max()) for k in reference) < 1e-6
    with pytest.raises(ConfigError, match="DDP job's model"):  # no Task to build it: said so
        load_model(result["model_path"])
