"""Real fedmq service processes on a fresh RabbitMQ vhost, for end-to-end tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.rabbit import fresh_vhost

REPO = Path(__file__).resolve().parents[2]


class Cluster:
    def __init__(self, url: str, root: Path, extra_env: dict[str, str] | None = None) -> None:
        self.url = url
        self.root = root
        self.env = {
            # On the CPU, as the embedded runs the tests compare with: a GPU gives other last bits.
            **os.environ, "FEDMQ_BROKER_URL": url, "FEDMQ_LOG_FORMAT": "json", "FEDMQ_DEVICE": "cpu",
            # The tests' own Tasks and strategies: services import a job's code from nowhere else.
            "FEDMQ_ALLOWED_CODE": "tests,examples",
            "FEDMQ_LIVENESS_S": "1", "COLUMNS": "200", **(extra_env or {}),
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._asker: Any = None  # an in-process client for the polls (a CLI process costs ~0.5 s CPU)
        secured = ("FEDMQ_TLS_", "FEDMQ_BROKER_PASSWORD")  # the CLI process reads those from its env
        self._plain = not any(key.startswith(secured) for key in (extra_env or {}))

    def _status(self, what: str, job_id: str = "") -> Any:
        """The scheduler's StatusReply, asked in this process; None if it did not answer.

        Polling through the CLI cost a process start per poll, most of the suite's CPU in waits;
        tests still drive the CLI itself for what they check (submit, watch, status output)."""
        from fedmq.common.errors import FedmqError
        from fedmq.common.settings import Settings
        from fedmq.services.cli.remote import Remote

        try:
            if self._asker is None:
                self._asker = Remote(Settings(broker_url=self.url)).__enter__()
            return self._asker.status(what, job_id)
        except (FedmqError, TimeoutError, ConnectionError):
            self.close()
            return None

    def close(self) -> None:
        if self._asker is not None:
            asker, self._asker = self._asker, None
            asker.__exit__(None, None, None)

    def start(self, service: str, name: str | None = None, **env: str) -> subprocess.Popen[bytes]:
        name = name or service
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - appends across restarts
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedmq.services.cli.main", service], cwd=REPO, stdout=log,
            stderr=subprocess.STDOUT, env={**self.env, "FEDMQ_STATE_DIR": str(self.root / name), **env},
        )
        self.procs[name] = proc
        return proc

    def fedmq(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fedmq.services.cli.main", *args], cwd=REPO, env=self.env,
            capture_output=True, text=True, timeout=timeout,
        )

    def wait_learners(self, count: int, timeout: float = 60) -> list[dict[str, Any]]:
        """Poll `fedmq learners` until `count` are alive (a condition with a deadline, not a sleep)."""
        deadline = time.monotonic() + timeout
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            rows = [r for r in self.learner_rows() if r["alive"]]
            if len(rows) >= count:
                return rows
            time.sleep(0.5)
        raise TimeoutError(f"only {len(rows)} of {count} learners registered; logs in {self.root}")

    def job_round(self, job_id: str) -> int:
        """The round a job is in, per `fedmq status`; -1 while the scheduler cannot answer."""
        if self._plain:
            reply = self._status("job", job_id)
            return int(reply.jobs[0]["round"]) if reply is not None and reply.jobs else -1
        proc = self.fedmq("status", job_id, "--json", timeout=60)
        try:
            return int(json.loads(proc.stdout)[0]["round"]) if proc.returncode == 0 else -1
        except (ValueError, KeyError, IndexError):
            return -1

    def learner_rows(self) -> list[dict[str, Any]]:
        if self._plain:
            reply = self._status("learners")
            return list(reply.learners) if reply is not None else []
        proc = self.fedmq("learners", "--json", timeout=30)
        return json.loads(proc.stdout) if proc.returncode == 0 else []

    def wait_for(self, condition: Callable[[], bool], timeout: float = 60) -> bool:
        """Poll `condition` until it holds or the deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.2)
        return False

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        return proc.wait(timeout)

    def stop_all(self) -> dict[str, int]:
        return {name: self.stop(name) for name in list(self.procs)}


@contextmanager
def services(url: str, root: Path, learners: int = 3, **extra_env: str) -> Iterator[Cluster]:
    """A scheduler, an aggregator and `learners` learners on the broker at `url`; killed afterwards."""
    c = Cluster(url, root, extra_env)
    try:
        c.start("scheduler")
        c.start("aggregator")
        for i in range(learners):
            c.start("learner", f"learner-{i}", FEDMQ_REPLICA=str(i))
        yield c
    finally:
        c.close()
        for proc in c.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@contextmanager
def cluster(root: Path, learners: int = 3, **extra_env: str) -> Iterator[Cluster]:
    """The services on a fresh vhost of the test broker."""
    with fresh_vhost() as url, services(url, root, learners, **extra_env) as c:
        yield c
