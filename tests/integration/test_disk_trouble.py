"""A state directory that fills up mid-job: the services wait, say so, and carry on once there is room.

Two outages in one job, each held until the failing write has been tried again: the scheduler's
SQLite database is full during round 2, the aggregator's disk (update spool, stored updates,
checkpoints) during round 3. Training of each round waits for the outage to begin, so the writes
that fail are the round's own. The job must finish with the undisturbed run's weights, with
nothing dead-lettered, no temporary file left behind and every checkpoint readable.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.messages import JobEvent
from fedmq.services.cli.embedded import run_job
from fedmq.services.scheduler import store as scheduler_store
from fedmq.services.scheduler.sampling import sample_clients
from tests.conftest import EmbeddedRuns, assert_bit_identical, small_job
from tests.integration import train_plugins
from tests.integration.conftest import Transport

WAIT = 60.0


class Outage:
    """A switch: while on, a write it watches fails; counts the failures so a test can wait for retries."""

    def __init__(self) -> None:
        self.on = False
        self.hits = 0
        self._changed = threading.Condition()

    def fail(self, error: Exception) -> None:
        with self._changed:
            self.hits += 1
            self._changed.notify_all()
        raise error

    def until(self, hits: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.hits >= hits, WAIT), f"only {self.hits} failed writes"


def full_disk_under(root: Path, outage: Outage, real: Callable[[int], None]) -> Callable[[int], None]:
    """os.fsync that fails with ENOSPC, while the outage is on, for files and folders under `root`."""

    def fsync(fd: int) -> None:
        if outage.on and Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(root):
            outage.fail(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        real(fd)

    return fsync


class FullDatabase:
    """A sqlite3 connection whose writes fail as on a full disk while the outage is on."""

    def __init__(self, db: sqlite3.Connection, outage: Outage) -> None:
        self._db = db
        self._outage = outage

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if self._outage.on and sql.lstrip().upper().startswith(("INSERT", "UPDATE")):
            self._outage.fail(sqlite3.OperationalError("database or disk is full"))
        return self._db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to tell files apart")
def test_a_full_state_directory_pauses_the_job_which_resumes_unchanged_once_there_is_room(
    transport: Transport, tmp_path: Path, embedded_runs: EmbeddedRuns, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bigger hidden layer: on RabbitMQ (64 KiB frames) every update arrives chunked, into the spool.
    spec = small_job(rounds=3, task__options__model={"name": "mlp", "hidden": [512]},
                     task__name="tests.integration.train_plugins:Gated")
    undisturbed = embedded_runs.weights(spec)  # before any gate is made
    settings = transport.settings.model_copy(update={"retry_initial_s": 0.05, "state_retry_max_s": 0.2})
    database, disk = Outage(), Outage()
    connect = sqlite3.connect
    monkeypatch.setattr(scheduler_store.sqlite3, "connect",
                        lambda *a, **k: FullDatabase(connect(*a, **k), database))
    monkeypatch.setattr(os, "fsync", full_disk_under(settings.state_dir / "aggregator", disk, os.fsync))
    gates = {r: [train_plugins.gate(spec.seed, r, c) for c in sample_clients(spec.seed, r, 5, 5)]
             for r in (2, 3)}

    def outage(during: int, switch: Outage, retried: int) -> None:
        switch.on = True
        for gate in gates[during]:
            gate.set()
        switch.until(retried)  # more failures than messages that could fail: some were retries
        switch.on = False

    def on_event(event: JobEvent) -> None:
        if event.kind == "round_completed" and event.round == 1:
            outage(during=2, switch=database, retried=10)  # ≤ 6 messages save during round 2
        if event.kind == "round_completed" and event.round == 2:
            outage(during=3, switch=disk, retried=3)  # one update at a time: the queue waits

    try:
        result = run_job(spec, settings, learners=2, connect=transport.connect, on_event=on_event,
                         idle_timeout=WAIT)
    finally:
        train_plugins.reset()
    assert result["status"] == "completed", result
    assert result["dead_letters"] == {}, "a write that failed is not a bad message"
    assert [(h["clients"], h["failed"]) for h in result["history"][1:]] == [(5, 0)] * 3
    assert_bit_identical(load_state(result["model_path"])[0], undisturbed)
    state = settings.state_dir / "aggregator"
    assert not [p for p in state.rglob("*") if p.name.endswith(".tmp")], "no half-written file is left"
    for checkpoint in state.rglob("checkpoints/*.safetensors"):
        load_state(checkpoint)  # every checkpoint reads back whole
