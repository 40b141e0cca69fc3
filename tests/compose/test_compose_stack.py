"""The compose stack for real (`make test-compose`): build, train, kill, take down and up again.

Not collected by `make test` or a plain `pytest` (pyproject's norecursedirs names tests/compose): it
needs a Docker engine and the compose-local tool (tests/compose/stack.py) and takes minutes. Without
them it skips loudly; under CI it fails. It ends with one summary line.

    up.sh, 3 learners                 `fedmq run` of the same spec here, meanwhile (the reference)
    job A: cli service `submit --watch`; SIGKILL one learner at round 3 and the aggregator at
           round 10, start them again -> completes with the reference's accuracy and weights
    Prometheus: every target up; every dashboard query answers over job A's minutes
    job B: cli service `submit`; `down` (volumes kept) at round 5; up.sh -> it resumes and completes,
           the reference's weights again
    down.sh (down -v), .env removed
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from fedmq.common.bus import topology
from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import load_job
from fedmq.common.logging import configure_logging
from fedmq.common.settings import Settings
from fedmq.services.cli.remote import Remote
from tests.ci import under_ci
from tests.compose import dashboard
from tests.compose.stack import AMQP_PORT, Stack, console, env_file, prometheus, unavailable
from tests.conftest import REPO, assert_bit_identical

SPEC = "examples/digits.yaml"
LEARNERS = 3
KILL_LEARNER_AT, KILL_AGGREGATOR_AT, DOWN_AT = 3, 10, 5
JOB_TIMEOUT_S = 300.0
TARGETS = {"scheduler": 1, "aggregator": 1, "learner": LEARNERS, "rabbitmq": 1, "prometheus": 1}
TORCH_BUILD = "import json, torch; print(json.dumps([torch.__version__, torch.__config__.show()]))"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Stack, Settings]]:
    """The stack's project with an .env; down -v afterwards, whatever happened. Skips without Docker."""
    reason = unavailable()
    if reason is not None:
        if under_ci():
            pytest.fail(f"the compose test needs a Docker engine under CI: {reason}")
        pytest.skip(f"SKIPPING COMPOSE TEST: {reason}")
    configure_logging("auto", "warning")  # as the CLI does: no bus_stats lines among the steps
    with env_file() as passwords:
        stack = Stack(learners=LEARNERS, log=tmp_path / "compose.log")
        cli = Settings(broker_url=f"amqp://cli@127.0.0.1:{AMQP_PORT}/fedmq",
                       broker_password=passwords["CLI_BROKER_PASSWORD"])
        try:
            yield stack, cli
        finally:
            try:
                stack.compose("logs", "--no-color", "--timestamps")  # into the log, for a post-mortem
            finally:
                stack.down(volumes=True)
                print(f"\ncompose commands and the services' logs: {stack.log}")


def host_fedmq(cli: Settings, *args: str, timeout: float = 120) -> str:
    """`fedmq ...` on this machine, against the stack's broker as the cli user; its stdout."""
    env = {"FEDMQ_BROKER_URL": cli.broker_url,
           "FEDMQ_BROKER_PASSWORD": cli.broker_password_value() or "", "FEDMQ_LOG_FORMAT": "json"}
    proc = subprocess.run([sys.executable, "-m", "fedmq", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})
    assert proc.returncode == 0, f"fedmq {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout


def step(since: float, what: str) -> None:
    print(f"== {time.monotonic() - since:3.0f} s  {what}", flush=True)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.2)


def running_round(remote: Remote, job_id: str, at_least: int) -> int:
    """Wait until a job is in round `at_least` or later and still running; that round."""
    seen: list[int] = []

    def reached() -> bool:
        reply = remote.status("job", job_id)
        if reply.error:  # not accepted yet
            return False
        job = reply.jobs[0]
        assert job["status"] == "running", f"job {job_id} {job['status']} before round {at_least}"
        seen[:] = [job["round"]]
        return job["round"] >= at_least

    wait_for(reached, JOB_TIMEOUT_S, f"round {at_least} of {job_id}")
    return seen[0]


def same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], same_torch: bool) -> None:
    """Bit for bit with one torch build; within float error across builds."""
    if same_torch:
        assert_bit_identical(a, b)
        return
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def model_metrics(final: dict[str, float]) -> dict[str, float]:
    """A result's final metrics less transport.*, which weighs this deployment's messages."""
    return {k: v for k, v in final.items() if not k.startswith("transport.")}


def resumed_at(stack: Stack, service: str, job_id: str) -> int | None:
    """The round a service's log says it resumed a job at (its `job_resumed` event), or None."""
    for line in stack.logs(service).splitlines():
        if '"job_resumed"' in line and f'"{job_id}"' in line:
            return int(json.loads(line.split("|", 1)[1])["round"])
    return None


def started_at(stack: Stack, container: str) -> str:
    return stack.docker("inspect", "-f", "{{.State.Running}} {{.State.StartedAt}}", container).strip()


def test_the_compose_stack_trains_survives_kills_and_resumes_after_down_and_up(
    stack: tuple[Stack, Settings], tmp_path: Path
) -> None:
    compose, cli = stack
    t0 = time.monotonic()
    rounds = load_job(REPO / SPEC).rounds
    reference_out = tmp_path / "reference.json"
    with reference_out.open("w") as out:
        reference_run = subprocess.Popen(
            [sys.executable, "-m", "fedmq", "run", SPEC, "--state-dir", str(tmp_path / "run"), "--json"],
            cwd=REPO, stdout=out, stderr=subprocess.DEVNULL)
    step(t0, f"up.sh, {LEARNERS} learners (the first build takes minutes; output in {compose.log})")
    compose.up()
    up_s = time.monotonic() - t0
    assert reference_run.wait(timeout=JOB_TIMEOUT_S) == 0, "fedmq run of the reference failed"
    reference = json.loads(reference_out.read_text())
    reference_model = load_state(reference["model_path"])[0]

    image_torch = json.loads(compose.compose("exec", "-T", "aggregator", "python", "-c", TORCH_BUILD))
    same_torch = image_torch == [torch.__version__, torch.__config__.show()]

    # Job A through the cli service, watched to its end, while a learner and the aggregator die.
    step(t0, "job A: submit --watch through the cli service; SIGKILL a learner, then the aggregator")
    printed, watch_log = tmp_path / "submit-a.out", tmp_path / "submit-a.err"  # the job id; the rest
    with printed.open("w") as out, watch_log.open("w") as err:
        watch_a = subprocess.Popen(compose.command("run", "--rm", "-T", "cli", "submit", SPEC, "--watch"),
                                   cwd=REPO, env=compose.env, stdout=out, stderr=err, text=True)
    try:
        wait_for(lambda: printed.read_text().endswith("\n"), 120, "submit to print the job id")
        job_a = printed.read_text().strip()
        t_a = time.time()
        with Remote(cli) as remote:
            learner_at = running_round(remote, job_a, KILL_LEARNER_AT)
            victim = compose.containers("learner")[1]
            before = started_at(compose, victim)
            compose.docker("kill", victim)
            running_round(remote, job_a, learner_at + 2)  # goes on with two learners
            compose.compose("start", "learner")
            wait_for(lambda: started_at(compose, victim).startswith("true")
                     and started_at(compose, victim) != before, 60, "the learner to run again")

            aggregator_at = running_round(remote, job_a, KILL_AGGREGATOR_AT)
            compose.compose("kill", "aggregator")
            compose.compose("start", "aggregator")
        assert watch_a.wait(timeout=JOB_TIMEOUT_S) == 0, watch_log.read_text()[-3000:]
    finally:
        if watch_a.poll() is None:
            watch_a.kill()
    watched = watch_log.read_text()
    assert f"completed after {rounds} rounds" in watched, watched[-3000:]
    shown = re.search(r"server\.accuracy: final ([0-9.]+)", watched)
    assert shown, watched[-3000:]
    assert resumed_at(compose, "aggregator", job_a) is not None, "the aggregator did not resume job A"

    result_a = json.loads(host_fedmq(cli, "watch", job_a, "--json"))
    assert [h["round"] for h in result_a["history"]] == list(range(rounds + 1))
    assert shown.group(1) == f"{reference['final']['server.accuracy']:.4f}"
    if same_torch:
        assert model_metrics(result_a["final"]) == model_metrics(reference["final"])
    else:
        assert model_metrics(result_a["final"]) == pytest.approx(model_metrics(reference["final"]), abs=1e-2)
    host_fedmq(cli, "model", job_a, "--out", str(tmp_path / "a.safetensors"))  # through the broker
    same_model(load_state(tmp_path / "a.safetensors")[0], reference_model, same_torch)

    # The console, behind its profile: refuses without the token, lists job A, serves its model.
    step(t0, "the console: --profile console up; job A's row and its model through the token")
    compose.compose("--profile", "console", "up", "-d", "console", timeout=300)
    try:
        wait_for(_answers, 90, "the console to answer /healthz")
        status, location, _, _ = console("/", None)
        assert status == 303 and location.startswith("/login"), (status, location)
        status, _, body, _ = console("/fragments/jobs", compose.console_token)
        assert status == 200 and job_a in body.decode() and "completed" in body.decode(), body[-2000:]
        status, _, body, headers = console(f"/jobs/{job_a}/model?which=final", compose.console_token)
        assert status == 200 and headers["x-fedmq-model-digest"] == result_a["model_digest"]
        (tmp_path / "console.safetensors").write_bytes(body)
        same_model(load_state(tmp_path / "console.safetensors")[0], reference_model, same_torch)
    finally:
        compose.compose("--profile", "console", "rm", "-sf", "console")

    # Prometheus: every target up; an undecodable message, so that the dead-letter panel has data.
    step(t0, "Prometheus: targets and the dashboard's queries")
    with Remote(cli) as remote:
        remote.bus.publish(topology.SCHEDULER, b"\xc1 not msgpack")
    up: collections.Counter[str] = collections.Counter()

    def all_up() -> bool:
        targets = prometheus("/api/v1/targets")["activeTargets"]
        up.clear()
        up.update(t["labels"]["job"] for t in targets if t["health"] == "up")
        return len(targets) == sum(up.values()) and dict(up) == TARGETS

    wait_for(all_up, 90, f"Prometheus targets {TARGETS} all up (up: {dict(up)})")
    dead = 'fedmq_messages_rejected_total{job="scheduler", reason="decode"} > 0'
    wait_for(lambda: bool(prometheus("/api/v1/query", query=dead)["result"]), 30,
             "Prometheus to scrape the scheduler's dead letter")
    # A step past now: the range's last evaluation then sees the latest scrape.
    end = time.time() + dashboard.STEP_S
    answers = {q: dashboard.ask(q, job_a, t_a - 30, end) for q in dashboard.queries()}
    missing = [f"{q.panel}: {q.expr}" for q, a in answers.items() if a == "none"]
    assert not missing, "dashboard queries with no data:\n" + "\n".join(missing)

    # Job B: submitted, the stack taken down mid-job (volumes kept) and brought up again.
    step(t0, "job B: submit, down (volumes kept) mid-job, up.sh, watch")
    job_b = compose.compose("run", "--rm", "-T", "cli", "submit", SPEC).split()[0]
    with Remote(cli) as remote:
        down_at = running_round(remote, job_b, DOWN_AT)
    compose.compose("logs", "--no-color", "--timestamps")  # into the log: `down` removes them
    compose.down(volumes=False)
    compose.up()
    result_b = json.loads(compose.compose("run", "--rm", "-T", "cli", "watch", job_b, "--json",
                                          timeout=JOB_TIMEOUT_S))
    assert result_b["status"] == "completed"
    assert [h["round"] for h in result_b["history"]] == list(range(rounds + 1))
    resumed = resumed_at(compose, "scheduler", job_b)
    assert resumed is not None, "the scheduler did not resume job B"
    assert resumed_at(compose, "aggregator", job_b) is not None, "the aggregator did not resume job B"
    compose.compose("cp", f"aggregator:{result_b['model_path']}", str(tmp_path / "b.safetensors"))
    same_model(load_state(tmp_path / "b.safetensors")[0], reference_model, same_torch)

    zero = sorted(q.name for q, a in answers.items() if a == "zero")
    weights = "bit-identical to" if same_torch else "within float error of"
    builds = "one torch build" if same_torch else f"torch {image_torch[0]} vs {torch.__version__} here"
    print(
        f"\ncompose: PASS: {LEARNERS} learners, {SPEC} ({rounds} rounds) through the cli service:"
        f" server.accuracy {shown.group(1)}, weights {weights} `fedmq run` ({builds});"
        f" survived SIGKILL of a learner at round {learner_at}, of the aggregator at round {aggregator_at};"
        f" down at round {down_at}, up, resumed at round {resumed}, completed with the same weights;"
        f" Prometheus {sum(up.values())} targets up; {len(answers)} dashboard queries answered:"
        f" {len(answers) - len(zero)} with data (dead letters: one forged message),"
        f" {len(zero)} zero: {', '.join(zero) or 'none'};"
        f" {time.monotonic() - t0:.0f} s (up.sh {up_s:.0f} s)"
    )


def _answers() -> bool:
    try:
        return console("/healthz", None)[0] == 200
    except OSError:
        return False
