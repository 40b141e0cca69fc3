"""The `fedmq` command as a user runs it: a real process, real files, real exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

FEDMQ = [sys.executable, "-m", "fedmq.services.cli.main"]


def fedmq(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [*FEDMQ, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_run_with_json_prints_a_round_history_and_saves_the_model(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = fedmq("run", "examples/digits.yaml", "--rounds", "2", "--json", "--state-dir", str(state))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "completed"
    assert [h["round"] for h in result["history"]] == [0, 1, 2]
    assert Path(result["model_path"]).is_file()
    assert Path(result["model_path"]).is_relative_to(state)
    assert "model saved to" in proc.stderr


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


GOOD = (REPO / "examples" / "digits.yaml").read_text()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t.replace("batch_size:", "batch_sise:"),
         ["train.batch_sise", "did you mean 'batch_size'"]),
        (lambda t: t.replace("lr: 0.05", "lr: -0.05"), ["train.lr", "greater than 0"]),
        (lambda t: t.replace("per_round: 10", "per_round: 11"), ["clients", "per_round (11)", "total (10)"]),
        (lambda t: t.replace("kind: dirichlet", "kind: dirichet"), ["task.options.partition", "dirichlet"]),
        (lambda t: t.replace("hidden: [128]", "hidden: [0]"),
         ["task.options.model.hidden.0", "greater than 0"]),
        (lambda t: t.replace("name: digits ", "name: no_such_pkg.tasks:Task "),
         ["no module named 'no_such_pkg'"]),
        (lambda t: t + "\nrounds: [", ["not valid YAML"]),
    ],
    ids=["typo", "negative-lr", "per-round-over-total", "unknown-partition", "bad-option", "no-task",
         "bad-yaml"],
)
def test_a_bad_spec_is_refused_before_anything_runs(tmp_path: Path, edit, expected) -> None:
    state = tmp_path / "state"
    proc = fedmq("run", str(write(tmp_path, edit(GOOD))), "--state-dir", str(state), timeout=60)
    assert proc.returncode == 2
    for text in expected:
        assert text in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not state.exists(), "nothing may run for a refused spec"


@pytest.mark.parametrize("name", ["regression", "gan", "charlm"])
def test_every_example_runs_with_fedmq_run(tmp_path: Path, name: str) -> None:
    proc = fedmq("run", f"examples/{name}.yaml", "--rounds", "2", "--json", "--state-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "completed" and result["rounds"] == 2
    objective = result["objective"]["metric"]
    assert objective in result["final"] and result["best"]["round"] in (0, 1, 2)
    assert f"best {objective}" in proc.stderr


def test_run_saves_the_objectives_best_round_as_a_model_beside_the_final_one(tmp_path: Path) -> None:
    from fedmq.common.checkpoint import load_state
    from fedmq.common.codec import state_digest

    proc = fedmq("run", "examples/regression.yaml", "--rounds", "6", "--json", "--state-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    weights, metadata = load_state(result["best_model_path"])
    assert state_digest(weights) == result["best"]["model_digest"]
    assert json.loads(metadata["fedmq.round"]) == result["best"]["round"]
    assert f"best model saved to {result['best_model_path']}" in proc.stderr


def test_a_missing_spec_file_is_one_clear_line(tmp_path: Path) -> None:
    proc = fedmq("run", str(tmp_path / "nope.yaml"), timeout=60)
    assert proc.returncode == 2
    assert "cannot read job spec" in proc.stderr
    assert "Traceback" not in proc.stderr
