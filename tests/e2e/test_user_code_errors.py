"""A job whose user code raises, on real service processes: `watch` exits 1 and `status` says where.

Before, a model builder raising in the aggregator dead-lettered the JobCreate and the job sat in
round 0 for ever: `watch` never returned.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.cluster import cluster

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker

TASK = "tests.integration.faulty_plugins:Faulty"
BROKEN = {
    "model": (
        "  name: digits ", f"  name: '{TASK}' ", "build_model",
        "user code failed in aggregator build_model (round 0) at tests/integration/faulty_plugins.py:",
    ),
    "train": (
        "  name: digits ", f"  name: '{TASK}' ", "train",
        "user code failed in learner train (round 1, client ",
    ),
}


def test_watch_and_status_say_which_user_code_failed_where(tmp_path: Path) -> None:
    specs = {}
    for name, (old, new, fail, _) in BROKEN.items():
        specs[name] = tmp_path / f"broken-{name}.yaml"
        text = (REPO / "examples" / "digits.yaml").read_text().replace("rounds: 30", "rounds: 2")
        text = text.replace(old, new).replace("  options:\n", f"  options:\n    fail: {fail}\n")
        specs[name].write_text(text)
    with cluster(tmp_path, learners=1) as c:
        c.wait_learners(1)
        for name, spec in specs.items():
            reason = BROKEN[name][3]
            watched = c.fedmq("submit", str(spec), "--watch", timeout=120)
            assert watched.returncode == 1, watched.stderr + c.log("aggregator")[-3000:]
            assert reason in " ".join(watched.stderr.split()), watched.stderr
            job_id = watched.stdout.strip().splitlines()[0]

            status = c.fedmq("status", job_id)
            assert status.returncode == 0 and reason in " ".join(status.stdout.split()), status.stdout
            row = json.loads(c.fedmq("status", job_id, "--json").stdout)[0]
            assert row["status"] == "failed"
            assert row["error"]["phase"] == ("build_model" if name == "model" else "train")
            late = c.fedmq("watch", job_id, timeout=60)  # a watcher arriving after the end
            assert late.returncode == 1 and reason in " ".join(late.stderr.split())
        assert c.stop_all() == {name: 0 for name in c.procs}, "every service is alive and stops cleanly"
