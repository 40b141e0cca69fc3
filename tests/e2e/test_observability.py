"""What an operator sees: every metric the dashboard plots exists and holds a sane value; logs are JSON."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO
from tests.e2e.cluster import cluster
from tests.rabbit_cluster import free_ports

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "fedmq.json"

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker


def free_port() -> int:
    """A port free now, below the ephemeral range: a port the kernel hands out for binding 0 may
    go to another test's outgoing connection before a service binds it (seen in CI: a learner
    died of "Address already in use" on its metrics port)."""
    return free_ports(1)[0]


Samples = dict[str, list[tuple[dict[str, str], float]]]  # by metric name: (labels, value)
Finished = tuple[dict[str, Samples], dict[str, str]]  # by service: its samples, its log


def scrape(port: int) -> Samples:
    """Samples by name from one /metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def dashboard_metrics() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"fedmq_[a-z_]+", e)}


def finished_job(root: Path) -> Finished:
    root.mkdir(parents=True)
    spec = root / "job.yaml"
    spec.write_text(
        (REPO / "examples" / "digits-100.yaml").read_text()
        .replace("rounds: 30", "rounds: 3").replace("epochs: 5", "epochs: 1")
        .replace("  name: digits ", "  name: 'tests.integration.train_plugins:WithMargin' ")
    )
    ports = dict(zip(("scheduler", "aggregator", "learner-0", "learner-1"), free_ports(4), strict=True))
    with cluster(root, learners=0) as c:
        for name in ("scheduler", "aggregator"):
            c.stop(name)
            c.start(name, FEDMQ_METRICS_PORT=str(ports[name]))
        for i in range(2):
            port = str(ports[f"learner-{i}"])
            c.start("learner", f"learner-{i}", FEDMQ_REPLICA=str(i), FEDMQ_METRICS_PORT=port)
        c.wait_learners(2)
        job_id = c.fedmq("submit", str(spec)).stdout.strip()
        proc = c.fedmq("watch", job_id, "--json")
        assert proc.returncode == 0, proc.stderr
        status = c.fedmq("status", job_id, "--json")
        samples = {name: scrape(port) for name, port in ports.items()}
        logs = {name: c.log(name) for name in ports}
    SEEN.update(watch=proc.stderr, watch_json=proc.stdout, status_json=status.stdout)
    return samples, logs


SEEN: dict[str, str] = {}  # what the user saw: `watch` (its summary), its --json, `status --json`


def check_a_tasks_own_metric_shows_in_watch_status_and_the_aggregators_metrics(finished: Finished) -> None:
    samples, _ = finished
    assert "server.margin: final" in SEEN["watch"]  # the summary watch prints
    assert "margin" in json.loads(SEEN["watch_json"])["history"][-1]["metrics"]["train"]
    (job,) = json.loads(SEEN["status_json"])
    assert "margin" in job["metrics"]["server"] and "margin" in job["history"][-1]["metrics"]["train"]
    names = {(labels["source"], labels["name"]) for labels, _ in samples["aggregator"]["fedmq_round_metric"]}
    assert {("server", "margin"), ("train", "margin")} <= names


def total(samples: dict[str, Samples], name: str) -> float:
    return sum(v for per_service in samples.values() for _, v in per_service.get(name, []))


def check_every_metric_the_dashboard_plots_is_exported(finished: Finished) -> None:
    samples, _ = finished
    exported = {name for per_service in samples.values() for name in per_service}
    wanted = dashboard_metrics()
    assert wanted, "the dashboard has no fedmq queries"
    for name in wanted:
        assert {name, f"{name}_total", f"{name}_bucket"} & exported, f"{name} is not exported"


def check_the_metrics_agree_with_the_job(finished: Finished) -> None:
    samples, _ = finished
    assert total(samples, "fedmq_rounds_completed_total") == 3
    exported = samples["aggregator"]["fedmq_round_metric"]
    metrics = {(labels["source"], labels["name"]): v for labels, v in exported}
    assert {("server", "accuracy"), ("server", "loss"), ("train", "accuracy")} <= set(metrics)
    assert 0.0 <= metrics["server", "accuracy"] <= 1.0
    assert total(samples, "fedmq_updates_accepted_total") == 3 * 10  # 10 sampled clients a round
    assert total(samples, "fedmq_round_duration_seconds_count") == 3
    assert total(samples, "fedmq_learner_train_seconds_count") == 30
    assert total(samples, "fedmq_learners_alive") == 2
    assert total(samples, "fedmq_bus_published_bytes_total") > 0
    assert total(samples, "fedmq_learner_model_fetches_total") == 0, "the small model came with the tasks"


def check_log_lines_written_while_handling_a_round_are_json_with_job_and_round(finished: Finished) -> None:
    _, logs = finished
    # A fused job's updates come as groups: "group_accepted" where one alone says "update_accepted".
    handling = {"group_accepted", "round_closed", "task_trained", "round_closing"}
    seen = set()
    for name, text in logs.items():
        for line in text.splitlines():
            record = json.loads(line)  # every line is JSON, pika's and the services' alike
            if record.get("event") in handling and record.get("round"):
                assert record.get("job"), (name, record)
                seen.add(record["event"])
    assert seen == handling


CHECKS = [
    check_a_tasks_own_metric_shows_in_watch_status_and_the_aggregators_metrics,
    check_every_metric_the_dashboard_plots_is_exported,
    check_the_metrics_agree_with_the_job,
    check_log_lines_written_while_handling_a_round_are_json_with_job_and_round,
]


def test_a_finished_jobs_metrics_logs_and_watch_say_what_happened(tmp_path: Path) -> None:
    """One test over one job run, not a test per check sharing a module fixture: pytest-xdist's
    worksteal may split a module's tests across workers, each then running the job again."""
    finished = finished_job(tmp_path / "obs")
    failures = {}
    for check in CHECKS:
        try:
            check(finished)
        except Exception as exc:  # each check's failure is reported, not only the first
            failures[check.__name__] = f"{type(exc).__name__}: {exc}"
    assert not failures, "\n\n".join(f"{name}: {why}" for name, why in failures.items())
