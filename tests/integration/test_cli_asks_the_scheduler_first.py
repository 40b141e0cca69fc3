"""`fedmq cancel` and `fedmq submit` ask the scheduler before they publish: an unknown job is an
error, a job no learner can train is a warning (and it still goes). On both buses."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner, Result

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import JobEvent, expect, from_wire
from fedmq.common.settings import Settings
from fedmq.services.aggregator.service import AggregatorService
from fedmq.services.cli import remote
from fedmq.services.cli.main import app
from fedmq.services.learner.service import LearnerService
from fedmq.services.scheduler.service import SchedulerService
from tests.conftest import small_job
from tests.integration.conftest import Transport

HANG = 30.0


class Cluster:
    """Services on the transport's buses, each run on its own thread, and every job event heard."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.buses: list[Bus] = []
        self.threads: list[threading.Thread] = []
        self.events: list[JobEvent] = []

    def run(self, bus: Bus) -> Bus:
        thread = threading.Thread(target=bus.run, daemon=True)
        thread.start()
        self.buses.append(bus)
        self.threads.append(thread)
        assert bus.wait_ready(HANG)
        return bus

    def start(self, *services: SchedulerService | AggregatorService | LearnerService) -> None:
        for service in services:
            service.start()
            self.run(service.bus)

    def listen(self) -> None:
        watcher = self.transport.connect("watcher")
        watcher.subscribe(topology.job_topic("*"), lambda body: self.events.append(expect(from_wire(body),
                                                                                         JobEvent)))
        self.run(watcher)

    def wait_for(self, kind: str) -> JobEvent:
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline:
            found = [e for e in self.events if e.kind == kind]
            if found:
                return found[0]
            threading.Event().wait(0.05)
        raise AssertionError(f"no {kind} event: {[e.kind for e in self.events]}")

    def stop(self) -> None:
        for bus in self.buses:
            bus.stop()
        for thread in self.threads:
            thread.join(HANG)


@contextmanager
def cluster(transport: Transport, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A scheduler, and the CLI's commands talking to it on this transport."""
    running = Cluster(transport)
    running.listen()
    if transport.broker is None:
        monkeypatch.setenv("FEDMQ_BROKER_URL", transport.url)
    else:  # the CLI's Remote on a bus of the in-memory broker
        cli, real = running.run(transport.connect("cli")), remote.Remote
        monkeypatch.setattr(remote, "Remote", lambda settings: real(settings, bus=cli))
    try:
        running.start(SchedulerService(transport.settings, transport.connect("scheduler")))
        yield running
    finally:
        running.stop()


def fedmq(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def spec_file(tmp_path: Path, spec: JobSpec) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return str(path)


def test_cancel_of_an_unknown_job_exits_2_naming_it_and_publishes_nothing(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    with cluster(transport, monkeypatch):
        result = fedmq("cancel", "no-such-job")
    assert result.exit_code == 2, result.output
    assert "no job 'no-such-job'" in result.output and "fedmq status" in result.output
    assert transport.dead() == []  # no JobCancel reached the scheduler to be dead-lettered


def test_submit_with_no_learner_alive_warns_and_the_job_waits_then_fails_as_it_said(
    transport: Transport, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = small_job(round_timeout_s=1.0, max_round_retries=1)
    with cluster(transport, monkeypatch) as running:
        running.start(AggregatorService(transport.settings, transport.connect("aggregator")))
        result = fedmq("submit", spec_file(tmp_path, spec))
        assert result.exit_code == 0, result.output
        assert "warning: no learner is alive" in result.output
        assert "with none it fails after 2 s (round_timeout_s 1 x 2 attempts)" in result.output
        failed = running.wait_for("failed")
        assert failed.data["reason"].startswith("round 1: no learner is alive: start one with `fedmq")
        assert "0 of 5 clients reported" in failed.data["reason"]
        again = fedmq("cancel", failed.job_id)  # an ended job: nothing to do, and it says so
    assert again.exit_code == 0 and "no longer running (failed): nothing to cancel" in again.output


def test_submit_with_a_learner_alive_does_not_warn_and_cancel_stops_the_job(
    transport: Transport, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = Settings(**{**transport.settings.model_dump(), "liveness_s": 0.2})
    spec = small_job(rounds=1000)
    with cluster(transport, monkeypatch) as running:
        learner = LearnerService(settings, transport.connect("learner-0"), replica=0)
        running.start(learner)
        deadline = time.monotonic() + HANG
        while not any(row["alive"] for row in json.loads(fedmq("learners", "--json").stdout)):
            assert time.monotonic() < deadline, "the scheduler never heard the learner"
        result = fedmq("submit", spec_file(tmp_path, spec))
        assert result.exit_code == 0, result.output
        # (the services' own logs may reach this output too: a learner late to beat on a loaded machine)
        assert "warning: no learner is alive" not in result.output
        job_id = result.stdout.strip()
        running.wait_for("accepted")
        cancelled = fedmq("cancel", job_id)
        assert cancelled.exit_code == 0 and f"cancel requested for {job_id}" in cancelled.output
        assert running.wait_for("cancelled").job_id == job_id
