"""A user's strategy from an entrypoint on the real services over RabbitMQ: its metrics reach
`fedmq watch`, `fedmq status` and the aggregator's /metrics, and its client state travels."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cluster import cluster
from tests.e2e.test_observability import free_port, scrape

pytestmark = pytest.mark.rabbitmq

SPEC = """
name: counting
seed: 3
task:
  name: tests.support.strategies:CountingDigits
  options: {model: {name: mlp, hidden: [32]}}
clients: {total: 4, per_round: 3}
rounds: 3
train: {epochs: 1, batch_size: 32, lr: 0.1}
strategy: {name: "tests.support.strategies:Counting", options: {scale: 1.0}}
objective: {metric: strategy.max_count, mode: max}
round_timeout_s: 120
"""


def test_a_users_strategy_metrics_show_in_watch_status_and_the_aggregators_metrics(tmp_path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)
    port = free_port()
    with cluster(tmp_path, learners=2) as c:
        c.stop("aggregator")
        c.start("aggregator", FEDMQ_METRICS_PORT=str(port))
        c.wait_learners(2)
        job_id = c.fedmq("submit", str(spec)).stdout.strip()
        watch = c.fedmq("watch", job_id, "--json")
        assert watch.returncode == 0, watch.stderr
        status = c.fedmq("status", job_id, "--json")
        samples = scrape(port)
    assert "strategy.max_count: final" in watch.stderr
    assert "best strategy.max_count (max)" in watch.stderr
    history = json.loads(watch.stdout)["history"]
    assert [h["metrics"]["strategy"]["mismatched"] for h in history[1:]] == [0.0, 0.0, 0.0]
    assert [h["metrics"]["strategy"]["server_rounds"] for h in history[1:]] == [1.0, 2.0, 3.0]
    (job,) = json.loads(status.stdout)
    assert job["history"][-1]["metrics"]["strategy"]["max_count"] >= 2.0  # 3 rounds of 3 of 4 clients
    shown = {labels["name"]: v for labels, v in samples["fedmq_round_metric"]
             if labels["source"] == "strategy" and labels["fl_job"] == job_id}
    assert shown["server_rounds"] == 3.0 and shown["mismatched"] == 0.0
