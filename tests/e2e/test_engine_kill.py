"""`fedmq run` SIGKILLed mid-job, then `--resume`: the job ends with an undisturbed run's model, bit
for bit."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fedmq.common.checkpoint import load_state
from tests.conftest import REPO, assert_bit_identical
from tests.e2e.test_cli_run import FEDMQ, fedmq
from tests.e2e.test_restarts import digits_keeping_optimizer_state

ROUNDS = "40"
KILL_AT = 4  # the kill comes once the journal names this round (checkpoints every 2 rounds)


def journal(state: Path) -> dict[str, object] | None:
    found = sorted((state / "engine").glob("*/journal.json"))
    if not found:
        return None
    try:
        return dict(json.loads(found[0].read_text()))
    except ValueError:  # being replaced: the rename is atomic, a read may still catch nothing
        return None


@pytest.mark.parametrize("client_state", [False, True], ids=["fedavg", "optimizer-state-kept"])
def test_a_sigkilled_run_resumes_from_its_last_checkpoint_to_the_undisturbed_weights(
    tmp_path: Path, client_state: bool
) -> None:
    spec = REPO / "examples" / "digits.yaml"
    if client_state:  # each client's momentum lives in the engine's memory between checkpoints
        spec = tmp_path / "job.yaml"
        spec.write_text(digits_keeping_optimizer_state((REPO / "examples" / "digits.yaml").read_text()))
    common = [str(spec), "--rounds", ROUNDS, "--json"]
    whole = fedmq("run", *common, "--state-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    expected = json.loads(whole.stdout)

    state = tmp_path / "killed"
    proc = subprocess.Popen([*FEDMQ, "run", *common, "--checkpoint-every", "2", "--state-dir", str(state)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while (doc := journal(state)) is None or int(doc["round"]) < KILL_AT:  # type: ignore[call-overload]
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached the kill"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    doc = journal(state)
    assert doc is not None and doc["status"] == "running", "killed after the job ended: nothing was tested"
    job_id = str(doc["job_id"])

    resumed = fedmq("run", *common, "--resume", job_id, "--state-dir", str(state))
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(resumed.stdout)
    assert result["status"] == "completed"
    assert [h["model_digest"] for h in result["history"]] == [h["model_digest"] for h in expected["history"]]
    assert_bit_identical(load_state(result["model_path"])[0], load_state(expected["model_path"])[0])
