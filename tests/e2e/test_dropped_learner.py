"""A learner that stops answering: the job finishes on the others, and the drop is visible."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.cluster import Cluster, cluster
from tests.e2e.test_observability import free_port

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker


def lost_learners(c: Cluster) -> list[str]:
    proc = c.fedmq("learners", "--json")
    return [r["learner"] for r in json.loads(proc.stdout) if not r["alive"]] if proc.returncode == 0 else []


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_a_frozen_learner_is_dropped_and_the_job_finishes_on_the_others(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        (REPO / "examples" / "digits.yaml").read_text().replace("rounds: 30", "rounds: 6")
        .replace("round_timeout_s: 120", "round_timeout_s: 4").replace("epochs: 5", "epochs: 1")
        # A learner's first task loads the job (data, imports): on a loaded CI machine that took
        # 14 s, three rounds' deadlines, and the job failed before the test froze anyone.
        + "max_round_retries: 20\n"
    )
    port = free_port()
    with cluster(tmp_path, learners=3) as c:
        c.stop("scheduler")
        c.start("scheduler", FEDMQ_METRICS_PORT=str(port))
        c.wait_learners(3)
        job_id = c.fedmq("submit", str(spec)).stdout.strip()
        assert c.wait_for(lambda: c.job_round(job_id) >= 2, timeout=120)
        frozen = c.procs["learner-0"]
        frozen.send_signal(signal.SIGSTOP)  # alive for the broker, silent for the scheduler
        try:
            watched = c.fedmq("watch", job_id, "--json", timeout=300)
            assert watched.returncode == 0, watched.stderr
            assert json.loads(watched.stdout)["status"] == "completed"
            # Declared lost after 3 silent heartbeat intervals, however fast the job ended.
            assert c.wait_for(lambda: len(lost_learners(c)) == 1, timeout=30)
            lost = lost_learners(c)
            status = c.fedmq("status").stdout
            assert c.wait_for(lambda: "fedmq_learners_alive 2.0" in scrape(port), timeout=10)
        finally:
            frozen.send_signal(signal.SIGCONT)
    assert len(lost) == 1 and lost[0].endswith("/0"), lost
    assert "1 lost" in status
