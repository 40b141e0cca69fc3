"""User code that raises, in any service and at any phase, fails its job at once and says where.

A job whose user code raises used to hang (the aggregator dead-lettered the message it was
handling and told no one) or cost only quorum (a learner's exception was a client failure).
Every scenario runs on the in-memory bus and on RabbitMQ; `idle_timeout` turns a hang into a
failure instead of a wait.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from fedmq.common.bus import topology
from fedmq.common.messages import JobEvent, JobSubmit, expect, from_wire, to_wire
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from fedmq.services.scheduler.service import SchedulerService
from tests.conftest import small_job
from tests.integration.conftest import Transport
from tests.integration.faulty_plugins import faulty

HANG = 30.0  # a job that fails as it should ends in about a second; no news this long is a hang

CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    # id: (spec changes, the error the job must report, a piece of the user's message)
    "aggregator-builds-the-model": (
        faulty("build_model"),
        {"service": "aggregator", "phase": "build_model", "type": "ValueError", "round": 0},
        "width must be positive",
    ),
    "aggregator-loads-its-server-data": (
        faulty("load_server_data"),
        {"service": "aggregator", "phase": "load_server_data", "type": "KeyError", "round": 0},
        "digits-test",
    ),
    "aggregator-evaluates-the-initial-model": (
        faulty("evaluate", fail_at=1),
        {"service": "aggregator", "phase": "evaluate", "type": "FloatingPointError", "round": 0},
        "overflow in the user's forward pass",
    ),
    "aggregator-evaluates-after-round-1-closes": (
        faulty("evaluate", fail_at=2),
        {"service": "aggregator", "phase": "evaluate", "type": "FloatingPointError", "round": 1},
        "overflow in the user's forward pass",
    ),
    "learner-builds-the-model": (
        faulty("build_model_on_learners"),
        {"service": "learner", "phase": "build_model", "type": "ImportError", "round": 1},
        "libcudnn",
    ),
    "learner-loads-its-data": (
        faulty("load_data"),
        {"service": "learner", "phase": "load_data", "type": "KeyError", "round": 1},
        "digits-7",
    ),
    "learner-builds-another-model": (
        faulty("model_differs_on_learners"),
        {"service": "learner", "phase": "build_model", "type": "ValueError", "round": 1},
        "does not match the global model",
    ),
    "learner-training-diverges": (
        faulty("diverge"),
        {"service": "learner", "phase": "train", "type": "FloatingPointError", "round": 1},
        "NaN or infinite values",
    ),
    "learner-trains": (
        faulty("train"),
        {"service": "learner", "phase": "train", "type": "RuntimeError", "round": 1},
        "illegal memory access",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_user_code_that_raises_fails_the_job_naming_phase_type_and_message(
    transport: Transport, case: str
) -> None:
    changes, expected, message = CASES[case]
    spec = small_job(rounds=2, **changes)
    result = run_job(spec, transport.settings, connect=transport.connect, idle_timeout=HANG)
    assert result["status"] == "failed", result
    error = result["error"]
    assert {k: error[k] for k in expected} == expected
    assert message in error["message"]
    if expected["service"] == "learner":
        assert isinstance(error["client"], int) and error["learner"], "which client, on which learner"
    for part in (expected["phase"], expected["type"], message):
        assert part in result["reason"], "the one-line reason says it all"
    assert result["dead_letters"] == {}, "nothing the job sent was refused"


def test_a_learner_error_only_costs_quorum_when_the_job_says_so(transport: Transport) -> None:
    spec = small_job(rounds=1, clients__on_error="drop_client", **faulty("train"))
    result = run_job(spec, transport.settings, connect=transport.connect, idle_timeout=HANG)
    assert result["status"] == "failed"
    assert "quorum is 5" in result["reason"] and "illegal memory access" in result["reason"]


def test_a_job_nobody_starts_fails_at_the_start_deadline(transport: Transport) -> None:
    # No aggregator: the initial model never comes, whatever the reason, and the job must not wait forever.
    settings = Settings(**{**transport.settings.model_dump(), "job_start_timeout_s": 0.5})
    scheduler = SchedulerService(settings, transport.connect("scheduler"))
    watcher = transport.connect("watcher")
    events: list[JobEvent] = []
    failed = threading.Event()

    def on_event(body: bytes) -> None:
        events.append(expect(from_wire(body), JobEvent))
        if events[-1].kind == "failed":
            failed.set()

    watcher.subscribe(topology.job_topic("unstarted"), on_event)
    threads = [threading.Thread(target=bus.run, daemon=True) for bus in (scheduler.bus, watcher)]
    scheduler.start()
    for thread in threads:
        thread.start()
    try:
        assert watcher.wait_ready(HANG) and scheduler.bus.wait_ready(HANG)
        submit = JobSubmit(job_id="unstarted", spec=small_job().model_dump(mode="json"))
        watcher.publish(topology.SCHEDULER, to_wire(submit))
        assert failed.wait(HANG), [e.kind for e in events]
    finally:
        for bus in (scheduler.bus, watcher):
            bus.stop()
        for thread in threads:
            thread.join(HANG)
    reason = events[-1].data["reason"]
    assert "did not start within 0.5 s" in reason and "aggregator" in reason
