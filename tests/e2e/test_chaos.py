"""Chaos: SIGKILL and restart every kind of service, and cut every connection, while a job runs.

The points come from a seeded generator (FEDMQ_CHAOS_SEED, default 7). The job must complete
with exactly the weights of an undisturbed run. Bounded in time; prints one summary line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import load_job
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import REPO, assert_bit_identical
from tests.e2e.cluster import cluster
from tests.rabbit import dead_letters

SEED = int(os.environ.get("FEDMQ_CHAOS_SEED", "7"))
LEARNERS = 3
BUDGET_S = 240.0



pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker


def test_the_example_job_survives_seeded_chaos(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    actions = ["learner"] * 3 + ["aggregator"] * 2 + ["scheduler", "broker"]
    rng.shuffle(actions)
    rounds = sorted(rng.sample(range(2, 27), len(actions)))
    plan = list(zip(rounds, actions, strict=True))
    spec_path = REPO / "examples" / "digits.yaml"
    deadline = time.monotonic() + BUDGET_S
    done: list[str] = []
    with cluster(tmp_path, learners=LEARNERS, FEDMQ_RETRY_INITIAL_S="0.2") as c:
        c.wait_learners(LEARNERS)
        job_id = c.fedmq("submit", str(spec_path)).stdout.strip()
        for at_round, action in plan:
            remaining = deadline - time.monotonic()
            def reached(r: int = at_round) -> bool:
                return c.job_round(job_id) >= r

            assert c.wait_for(reached, timeout=max(1.0, remaining)), (
                f"stuck before round {at_round} after {done}"
            )
            time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside the round
            if action == "broker":
                vhost = urlsplit(c.url).path.lstrip("/")
                subprocess.run(["rabbitmqctl", "-q", "close_all_connections", "-p", vhost, "chaos"],
                               check=True, capture_output=True, timeout=60)
            else:
                name = f"learner-{rng.randrange(LEARNERS)}" if action == "learner" else action
                c.stop(name, signal.SIGKILL)
                env = {"FEDMQ_REPLICA": name.split("-")[1]} if action == "learner" else {}
                c.start("learner" if action == "learner" else action, name, **env)
            done.append(f"{action}@{at_round}")
        watched = c.fedmq("watch", job_id, "--json", timeout=max(10.0, deadline - time.monotonic()))
        assert watched.returncode == 0, watched.stderr + c.log("aggregator")[-3000:]
        result = json.loads(watched.stdout)
        logs = {name: c.log(name) for name in c.procs}
        dead = dead_letters(c.url)
    redelivered = sum(text.count('"task_redelivered"') for text in logs.values())
    duplicates = logs["aggregator"].count('"update_duplicate"')
    print(
        f"\nchaos seed={SEED}: survived {len(done)} disruptions ({', '.join(done)}); "
        f"tasks redelivered={redelivered}, duplicate updates ignored={duplicates}, "
        f"dead-lettered={len(dead)} ({sorted({str(h.get('x-fedmq-reason', '?'))[:30] for h, _ in dead})})"
    )
    assert result["status"] == "completed"
    assert [h["round"] for h in result["history"]] == list(range(31))
    embedded = run_job(load_job(spec_path), Settings(state_dir=tmp_path / "embedded"))
    assert_bit_identical(load_state(result["model_path"])[0], load_state(embedded["model_path"])[0])
