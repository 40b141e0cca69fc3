"""`fedmq run` stopped as Ctrl-C stops it, then resumed, in this process on the in-memory bus.

tests/e2e/test_interrupt.py presses Ctrl-C on the real command; these reach the same stop
through the same path (the follower told to interrupt) and check what resuming does with it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedmq.common.bus import topology
from fedmq.common.checkpoint import load_state
from fedmq.common.messages import StatusReply, StatusRequest, expect, from_wire, to_wire
from fedmq.common.settings import Settings
from fedmq.services.cli import pause
from fedmq.services.cli.embedded import run_job
from fedmq.services.cli.follow import JobFollower
from fedmq.services.cli.interrupt import Interrupt, Interruptible
from fedmq.services.learner.service import LearnerService
from tests.conftest import EmbeddedRuns, assert_bit_identical, small_job
from tests.integration import train_plugins


class InterruptWhen(Interrupt):
    """Ctrl-C as the signal handler gives it, once the scheduler's record of the job says `ready`."""

    def __init__(self, ready: Callable[[dict[str, Any]], bool]) -> None:
        super().__init__(resume_hint="")
        self.ready = ready

    def attach(self, follower: Interruptible) -> None:
        assert isinstance(follower, JobFollower)
        super().attach(follower)
        threading.Thread(target=self._watch, args=(follower,), daemon=True).start()

    def _watch(self, follower: JobFollower) -> None:
        deadline = time.monotonic() + 60  # a condition polled with a deadline, not a sleep to order
        while time.monotonic() < deadline:
            request = to_wire(StatusRequest(job_id=follower.job_id, what="job"))
            body = follower.bus.request(topology.SCHEDULER, request, timeout=10)
            reply = expect(from_wire(body), StatusReply)
            if reply.jobs and self.ready(reply.jobs[0]):
                follower.interrupt()
                return
            time.sleep(0.02)


def test_a_run_stopped_mid_job_resumes_to_the_undisturbed_weights(
    settings: Settings, embedded_runs: EmbeddedRuns
) -> None:
    # Its rounds would wait 480 s to send lost tasks again: the resumed run must not need that.
    spec = small_job(rounds=5, round_timeout_s=600)
    with pytest.raises(KeyboardInterrupt):
        run_job(spec, settings, learners=3, job_id="paused", idle_timeout=60,
                interrupt=InterruptWhen(lambda job: job["round"] >= 3))
    assert (pause.load(settings.state_dir) is not None) and [
        j.status for j in pause.stored_jobs(settings.state_dir)] == ["running"]

    heard: list[int | None] = []
    result = run_job(spec, settings, learners=3, job_id="paused", resume=True, idle_timeout=60,
                     on_event=lambda event: heard.append(event.round))
    assert result["status"] == "completed"
    assert [h["round"] for h in result["history"]] == list(range(spec.rounds + 1))
    assert heard[:3] == [None, 0, 1], "the rounds done before the stop are told first"
    assert pause.load(settings.state_dir) is None
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))


def test_time_spent_stopped_closes_no_round_early(
    settings: Settings, embedded_runs: EmbeddedRuns, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 3 stops with 4 of 5 updates in: over its quorum of 3. Had the pause counted against
    # the round's deadline, the resumed scheduler would close it at once without client 4.
    spec = small_job(rounds=4, clients__min_fit=3, task__name="tests.integration.train_plugins:Gated")
    undisturbed = embedded_runs.weights(spec)
    held = train_plugins.gate(spec.seed, 3, 4)
    stopping = LearnerService.shutdown
    stopped: list[LearnerService] = []

    def shutdown(learner: LearnerService) -> None:
        stopping(learner)
        stopped.append(learner)
        if len(stopped) == 2:
            held.set()  # client 4 trains only once no learner may publish it

    monkeypatch.setattr(LearnerService, "shutdown", shutdown)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_job(spec, settings, learners=2, job_id="paused", idle_timeout=60,
                    interrupt=InterruptWhen(lambda job: job["round"] == 3 and job.get("reported") == 4))
    finally:
        train_plugins.reset()
    monkeypatch.undo()
    away = 3600.0  # an hour away from the keyboard, many times the round's 60 s
    pause.shift_deadlines(settings.state_dir, -away)  # the clock moves on past the round's deadline
    record = pause.load(settings.state_dir)
    assert record is not None
    meta = Path(record.path) / "pause.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "paused_at": record.paused_at - away}))

    result = run_job(spec, settings, learners=2, job_id="paused", resume=True, idle_timeout=60)
    assert result["status"] == "completed"
    assert result["history"][3]["clients"] == 5
    assert_bit_identical(load_state(result["model_path"])[0], undisturbed)
