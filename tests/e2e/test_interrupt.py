"""Ctrl-C on `fedmq run`, on the engine and on the services (`--services`): an orderly stop, exit 130,
and a resume that ends where a run never interrupted ends, bit for bit.

The runs train through `tests.integration.train_plugins:Gated`: the first rounds pass, then
every training waits for a file, so a test knows the job is mid-round when it presses Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import yaml

from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import JobSpec
from tests.conftest import REPO, EmbeddedRuns, assert_bit_identical, small_job

FEDMQ = [sys.executable, "-m", "fedmq.services.cli.main"]


def write_spec(tmp_path: Path) -> tuple[JobSpec, Path]:
    spec = small_job(rounds=5, task__name="tests.integration.train_plugins:Gated")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return spec, path


def fedmq_run(path: Path, state: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """`fedmq run --services` with three learners and the services' logs (JSON lines) on stderr."""
    return subprocess.Popen(
        [*FEDMQ, "run", str(path), "--state-dir", str(state), "--services", "--learners", "3", "-v", *args],
        cwd=REPO, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def fedmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FEDMQ, "run", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def read_until(stream: IO[str], found: str | tuple[str, int]) -> str:
    """Lines of `stream` up to one containing `found`, or logging event `found` = (event, round)."""
    seen = []
    for line in stream:
        seen.append(line)
        if isinstance(found, str):
            if found in line:
                return "".join(seen)
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (record.get("event"), record.get("round")) == found:
            return "".join(seen)
    raise AssertionError(f"the run ended before {found!r}:\n" + "".join(seen[-40:]))


def test_ctrl_c_stops_the_run_and_the_resumed_run_ends_with_the_undisturbed_weights(
    tmp_path: Path, embedded_runs: EmbeddedRuns
) -> None:
    spec, path = write_spec(tmp_path)
    state, gate = tmp_path / "state", tmp_path / "gate"
    run = fedmq_run(path, state, FEDMQ_TEST_TRAIN_GATE=str(gate),
                    FEDMQ_TEST_TRAIN_GATE_AFTER=str(2 * spec.clients.sampled))
    assert run.stderr is not None
    before = read_until(run.stderr, ("round_closed", 2))  # round 3's trainings wait at the gate
    run.send_signal(signal.SIGINT)
    gate.touch()  # and train on while the run stops
    _, after = run.communicate(timeout=120)
    err = before + after
    assert run.returncode == 130, err[-4000:]
    assert "terminate called" not in err and "Traceback" not in err, err[-4000:]
    hint = re.search(r"fedmq run .*--resume (\S+) --state-dir (\S+)", err)
    assert hint is not None, err[-2000:]
    job_id, hinted_state = hint.groups()
    assert Path(hinted_state) == state
    assert "start over" in err

    # Nothing runs beside the stopped job, nor from another spec than it began with.
    for args, refusal in [
        ([], f"holds job {job_id}, stopped in round"),
        (["--resume", "nope"], "holds no job nope"),
        (["--resume", job_id, "--rounds", "6"], "started from another spec"),
    ]:
        refused = fedmq(str(path), "--state-dir", str(state), "--services", *args)
        assert (refused.returncode, refusal in refused.stderr) == (2, True), refused.stderr

    resumed = fedmq(str(path), "--resume", job_id, "--state-dir", str(state), "--services", "--json")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    result = json.loads(resumed.stdout)
    assert (result["status"], result["job_id"]) == ("completed", job_id)
    assert [h["round"] for h in result["history"]] == list(range(spec.rounds + 1))
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))


def test_ctrl_c_on_the_engine_checkpoints_the_round_in_progress_and_the_resumed_run_ends_alike(
    tmp_path: Path, embedded_runs: EmbeddedRuns
) -> None:
    spec, path = write_spec(tmp_path)
    state, gate = tmp_path / "state", tmp_path / "gate"
    run = subprocess.Popen(
        [*FEDMQ, "run", str(path), "--state-dir", str(state), "-v"], cwd=REPO, text=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "FEDMQ_TEST_TRAIN_GATE": str(gate),
             "FEDMQ_TEST_TRAIN_GATE_AFTER": str(2 * spec.clients.sampled)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert run.stderr is not None
    before = read_until(run.stderr, ("round_started", 3))  # its trainings wait at the gate
    run.send_signal(signal.SIGINT)
    gate.touch()  # round 3 trains on, and is checkpointed
    _, after = run.communicate(timeout=120)
    err = before + after
    assert run.returncode == 130, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert "the round in progress finishes and is checkpointed" in err
    hint = re.search(r"fedmq run .*--resume (\S+) --state-dir (\S+)", err)
    assert hint is not None, err[-2000:]
    job_id = hint.group(1)
    assert "stopped in round 3 of 5" in err, err[-2000:]

    resumed = fedmq(str(path), "--resume", job_id, "--state-dir", str(state), "--json")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    result = json.loads(resumed.stdout)
    assert (result["status"], result["job_id"]) == ("completed", job_id)
    assert [h["round"] for h in result["history"]] == list(range(spec.rounds + 1))
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))


def test_a_second_ctrl_c_while_the_run_stops_quits_at_once_still_with_130(tmp_path: Path) -> None:
    spec, path = write_spec(tmp_path)
    run = fedmq_run(path, tmp_path / "state", FEDMQ_TEST_TRAIN_GATE=str(tmp_path / "never"),
                    FEDMQ_TEST_TRAIN_GATE_AFTER=str(spec.clients.sampled))
    assert run.stderr is not None
    before = read_until(run.stderr, ("round_closed", 1))  # round 2's trainings wait for good
    run.send_signal(signal.SIGINT)
    before += read_until(run.stderr, "Ctrl-C again")  # stopping: it waits for those trainings
    run.send_signal(signal.SIGINT)
    _, after = run.communicate(timeout=60)
    err = before + after
    assert run.returncode == 130, err[-4000:]
    assert "terminate called" not in err and "Traceback" not in err, err[-4000:]
    assert "--resume" in err
