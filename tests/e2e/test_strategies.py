"""Every built-in strategy on the real services over RabbitMQ, the aggregator SIGKILLed mid-job: each
job's weights, every round's model digest and strategy metrics are the in-process engine's, bit for
bit (state restored).

One cluster runs every case of tests/support/strategy_cases.py at once (the jobs are independent):
a cluster per case would spend most of its time starting processes. Each job is examples/digits.yaml
cut short (ROUNDS rounds of EPOCHS epoch), with the case's strategy section.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import load_job
from fedmq.common.messages import JobSubmit
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import new_job_id
from fedmq.services.cli.remote import Remote, SchedulerSilent
from fedmq.services.engine.run import run_job
from tests.conftest import assert_bit_identical
from tests.e2e.cluster import Cluster, cluster
from tests.support.strategy_cases import CASES
from tests.support.strategy_specs import write_digits_spec

ROUNDS = 6
EPOCHS = 1
KILL_AFTER = 2  # the aggregator dies once every job has closed this many rounds
TIMEOUT_S = 600.0  # for each wait of the cluster run

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(2 * TIMEOUT_S + 300)]


def jobs_by_id(remote: Remote) -> dict[str, dict[str, Any]]:
    return {job["job_id"]: job for job in remote.status("jobs").jobs}


def wait_jobs(c: Cluster, remote: Remote, ids: list[str], done: Any, what: str) -> dict[str, dict[str, Any]]:
    """Poll the scheduler until `done(job)` holds for every job in `ids`; their status rows."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            jobs = jobs_by_id(remote)
        except SchedulerSilent:  # busy with every job's rounds: ask again
            continue
        if all(job_id in jobs and done(jobs[job_id]) for job_id in ids):
            return jobs
        time.sleep(0.2)
    raise TimeoutError(f"jobs never {what}; logs in {c.root}")


def resumed_rounds(log: str) -> dict[str, int]:
    """Each job the restarted aggregator picked up from disk, with its last committed round."""
    events = (json.loads(line) for line in log.splitlines() if '"job_resumed"' in line)
    return {e["job"]: e["round"] for e in events}


def run_on_rabbitmq(root: Path) -> dict[str, dict[str, Any]]:
    """Every case's job run together on one cluster, its aggregator SIGKILLed mid-job and restarted."""
    specs = {case: write_digits_spec(root / "specs", case, ROUNDS, EPOCHS) for case in CASES}
    # every case at once: more jobs than FEDMQ_MAX_JOBS allows by default
    with cluster(root, learners=2, FEDMQ_MAX_JOBS=str(len(CASES))) as c, \
            Remote(Settings(broker_url=c.url)) as remote:
        c.wait_learners(2)
        ids: dict[str, str] = {}
        for case, path in specs.items():
            spec = load_job(path)
            ids[case] = new_job_id(spec)
            remote.send(JobSubmit(job_id=ids[case], spec=spec.model_dump(mode="json")))
        wait_jobs(c, remote, list(ids.values()), lambda job: job["round"] > KILL_AFTER, "reached the kill")
        c.stop("aggregator", signal.SIGKILL)
        c.start("aggregator")  # same state directory: it must pick every job up
        wait_jobs(c, remote, list(ids.values()), lambda job: job["status"] != "running", "ended")
        resumed = resumed_rounds(c.log("aggregator"))
        return {
            case: {"spec": specs[case], "job": remote.status("job", job_id).jobs[0],
                   "resumed_round": resumed.get(job_id), "root": root}
            for case, job_id in ids.items()
        }


def check_case(case: str, run: dict[str, Any], tmp_path: Path) -> None:
    job = run["job"]
    assert job["status"] == "completed", f"{job.get('reason')}; logs in {run['root']}"
    assert run["resumed_round"] is not None and run["resumed_round"] < ROUNDS, (
        f"the aggregator was killed after the job ended, not in it (resumed at {run['resumed_round']})")

    # The engine with the services' defaults (one torch thread, as each learner process has).
    engine = run_job(load_job(run["spec"]), Settings(state_dir=tmp_path))
    assert engine["status"] == "completed", engine.get("reason")
    assert_bit_identical(load_state(job["model_path"])[0], load_state(engine["model_path"])[0])
    assert [h["round"] for h in job["history"]] == list(range(ROUNDS + 1))
    assert [h["model_digest"] for h in job["history"]] == [h["model_digest"] for h in engine["history"]]
    assert [h["metrics"].get("strategy") for h in job["history"]] == [
        h["metrics"].get("strategy") for h in engine["history"]], "the strategy's state was restored"
    accuracy = [h["metrics"]["server"]["accuracy"] for h in job["history"]]
    assert accuracy[-1] > accuracy[0], f"{case} learned nothing in {ROUNDS} rounds: {accuracy}"


def test_every_strategy_on_rabbitmq_across_an_aggregator_sigkill_is_the_engines_run_bit_for_bit(
    tmp_path: Path,
) -> None:
    """One test, not one per case: pytest-xdist's worksteal splits a module's tests across workers,
    and each worker then ran the whole shared cluster run again (CI: 147 s and 139 s, twice)."""
    runs = run_on_rabbitmq(tmp_path / "cluster")
    failures = {}
    for case in sorted(CASES):
        try:
            check_case(case, runs[case], tmp_path / case)
        except Exception as exc:  # one case's failure, whatever it is, leaves the others to be checked
            failures[case] = f"{type(exc).__name__}: {exc}"
    assert not failures, "\n\n".join(f"{case}: {why}" for case, why in failures.items())
