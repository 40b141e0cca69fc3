"""DDP jobs on real learner processes (issue 15, seed 003): parity, torchrun, restarts, failure.

examples/ddp.py trains the digits MLP with 2 gloo ranks on 2 learners. Its weights must equal
one process training on each step's combined batch (within 1e-6), and `torchrun` running the
same file. SIGKILL of a rank's learner mid-training restarts the group from the last checkpoint
on the learners still alive (one spare here) and the job ends with the undisturbed weights; with
max_restarts 0 it fails, naming the rank and node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.ddp import reference_weights
from fedmq.common.checkpoint import load_state
from tests.conftest import REPO
from tests.e2e.cluster import Cluster, cluster
from tests.e2e.test_observability import scrape
from tests.rabbit_cluster import free_ports

pytestmark = pytest.mark.rabbitmq

TOLERANCE = 1e-6


def _spec(tmp_path: Path, name: str, port: int, restarts: int = 1, **options: object) -> Path:
    opts = {"epochs": 3, "batch_size": 32, "lr": 0.05, "hidden": [64], "seed": 0, **options}
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"name: {name}\nseed: 0\nddp:\n  entry: \"examples.ddp:main\"\n  world_size: 2\n"
        f"  master_port: {port}\n  max_restarts: {restarts}\n  options: {json.dumps(opts)}\n"
    )
    return spec


def _free_port() -> int:
    return free_ports(1)[0]  # below the ephemeral range: no outgoing connection takes it meanwhile


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _watch(c: Cluster, job_id: str) -> dict:
    watched = c.fedmq("watch", job_id, "--json", timeout=240)
    return {"rc": watched.returncode, **json.loads(watched.stdout or "{}"), "stderr": watched.stderr}


def test_two_gloo_ranks_match_one_process_and_torchrun(tmp_path: Path) -> None:
    metrics_port = _free_port()
    with cluster(tmp_path, learners=2, FEDMQ_NODE="127.0.0.1") as c:
        c.stop("scheduler")
        c.start("scheduler", FEDMQ_METRICS_PORT=str(metrics_port))
        c.wait_learners(2)
        job_id = c.fedmq("submit", str(_spec(tmp_path, "ddp-parity", _free_port()))).stdout.strip()
        result = _watch(c, job_id)
        logs = c.log("scheduler")
        samples = scrape(metrics_port)
    assert result["rc"] == 0 and result["status"] == "completed", str(result) + logs[-3000:]
    # The entry's output streamed to watch, its reports on the bar, in the record and in Prometheus.
    reports = result["history"][-1]["reports"]
    assert [r["step"] for r in reports] == [1, 2, 3]
    assert f"rank 0 epoch 3/3 loss {reports[-1]['metrics']['loss']:.4f}" in result["stderr"]
    assert ("train.loss", reports[-1]["metrics"]["loss"]) in [
        (f"{labels['source']}.{labels['name']}", value) for labels, value in samples["fedmq_round_metric"]
        if labels["fl_job"] == job_id
    ]
    assert samples["fedmq_ddp_step"] == [({"fl_job": job_id}, 3.0)]
    launched = [json.loads(line) for line in logs.splitlines() if '"ddp_launched"' in line]
    assert sorted(launched[0]["members"].values()) == [0, 1]  # seed 003's ranks, one per learner
    fedmq_weights = load_state(result["model_path"])[0]
    reference = reference_weights({"epochs": 3}, world_size=2)
    assert _close(fedmq_weights, reference) < TOLERANCE
    # The same file under torchrun, as a user would compare.
    out = tmp_path / "torchrun"
    env = {**os.environ, "FEDMQ_DDP_DIR": str(out), "PYTHONPATH": str(REPO),
           "FEDMQ_DDP_OPTIONS": json.dumps({"epochs": 3})}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), str(REPO / "examples" / "ddp.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    torchrun_weights = load_state(out / "model.safetensors")[0]
    assert _close(torchrun_weights, fedmq_weights) < TOLERANCE


def _kill_a_rank(c: Cluster, job_id: str) -> str:
    """SIGKILL a learner running a rank once the group has saved a checkpoint; its name."""
    checkpointed = c.wait_for(lambda: '"ddp_checkpoint"' in c.log("scheduler"), timeout=120)
    assert checkpointed, c.log("scheduler")[-3000:]
    rows = [row for row in c.learner_rows() if row["alive"] and row.get("group", "").startswith(job_id)]
    assert rows, c.learner_rows()
    victim = next(name for name in c.procs if name.startswith("learner-")
                  and c.procs[name].poll() is None and f'"pid": {c.procs[name].pid}' in json.dumps(rows))
    c.stop(victim, signal.SIGKILL)
    return victim


def test_a_killed_ranks_learner_restarts_the_group_from_its_checkpoint(tmp_path: Path) -> None:
    with cluster(tmp_path, learners=3, FEDMQ_NODE="127.0.0.1") as c:
        c.wait_learners(3)
        spec = _spec(tmp_path, "ddp-restart", _free_port(), epochs=4, epoch_pause_s=0.4)
        job_id = c.fedmq("submit", str(spec)).stdout.strip()
        victim = _kill_a_rank(c, job_id)
        result = _watch(c, job_id)
        logs = c.log("scheduler")
    assert result["rc"] == 0 and result["status"] == "completed", str(result) + logs[-3000:]
    assert '"ddp_restart"' in logs and result["history"][-1]["attempts"] == 2, victim
    resumed = [json.loads(line) for line in logs.splitlines() if '"ddp_launched"' in line][-1]
    assert resumed["resume"], "the second attempt did not start from a checkpoint"
    # Resumed at an epoch boundary with the sampler's epoch-seeded order: the undisturbed weights.
    assert _close(load_state(result["model_path"])[0], reference_weights({"epochs": 4}, 2)) < TOLERANCE


def test_with_no_restarts_left_the_job_fails_naming_the_rank_and_node(tmp_path: Path) -> None:
    with cluster(tmp_path, learners=2, FEDMQ_NODE="127.0.0.1") as c:
        c.wait_learners(2)
        spec = _spec(tmp_path, "ddp-fail", _free_port(), restarts=0, epochs=4, epoch_pause_s=0.4)
        job_id = c.fedmq("submit", str(spec)).stdout.strip()
        _kill_a_rank(c, job_id)
        result = _watch(c, job_id)
    assert result["rc"] == 1 and result["status"] == "failed", result
    assert "DDP rank" in result["reason"] and "on node 127.0.0.1" in result["reason"], result["reason"]
    assert "0 of 0 restarts used" in result["reason"]
