"""Ctrl-C on `fedmq watch` and `fedmq submit --watch`: one line saying the job goes on, exit 130,
no traceback. The CLI is a real process on RabbitMQ; the scheduler runs in the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.messages import StatusRequest
from fedmq.common.settings import Settings
from fedmq.services.scheduler import service as scheduler_module
from fedmq.services.scheduler.service import SchedulerService
from tests.conftest import REPO, small_job
from tests.rabbit import fresh_vhost

pytestmark = pytest.mark.rabbitmq

HANG = 60.0


@contextmanager
def scheduler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, threading.Event]]:
    """A scheduler alone (no aggregator: a job it takes stays at round 0), its broker URL, and an
    event set when someone asks it for one job's status (`watch` does, then follows the job)."""
    asked = threading.Event()
    reply = scheduler_module.status_reply

    def noting(msg: StatusRequest, *args: Any) -> Any:
        if msg.what == "job":
            asked.set()
        return reply(msg, *args)

    monkeypatch.setattr(scheduler_module, "status_reply", noting)
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path / "state", log_format="json")
        service = SchedulerService(settings, RabbitBus(settings, "scheduler"))
        service.start()
        thread = threading.Thread(target=service.bus.run, daemon=True)
        thread.start()
        try:
            assert service.bus.wait_ready(HANG)
            yield url, asked
        finally:
            service.bus.stop()
            thread.join(HANG)


def ctrl_c(url: str, asked: threading.Event, *args: str) -> subprocess.CompletedProcess[str]:
    """`fedmq ARGS`, interrupted once it asked for the job's status (it is then watching)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedmq", *args], cwd=REPO, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "FEDMQ_BROKER_URL": url, "COLUMNS": "200"},
        # A pytest-xdist worker ignores SIGINT, and a child inherits that: give it a terminal's.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert asked.wait(HANG), "the CLI never asked for the job"
        threading.Event().wait(3.0)  # from the status reply into the event loop, on a loaded machine too
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=HANG)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def spec_file(tmp_path: Path) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(small_job().model_dump(mode="json")))
    return str(path)


def test_ctrl_c_in_submit_watch_and_then_in_watch_is_one_line_and_exit_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with scheduler(tmp_path, monkeypatch) as (url, asked):
        submitted = ctrl_c(url, asked, "submit", spec_file(tmp_path), "--watch")
        job_id = submitted.stdout.strip()
        asked.clear()
        watched = ctrl_c(url, asked, "watch", job_id)
    for done in (submitted, watched):
        assert done.returncode == 130, done.stderr
        assert "Traceback" not in done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last == f"stopped watching; job {job_id} goes on (`fedmq cancel {job_id}` stops it)"
