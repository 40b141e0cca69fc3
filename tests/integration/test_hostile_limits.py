"""Implausible updates and oversized submissions on a real RabbitMQ while a job runs: each is
refused with its reason and counted, and the job ends with exactly the undisturbed weights.

A forged update for a real client of round 2 claims 1000x the examples that client reported in
round 1; another moves the weights 100 away (over the spec's clients.max_update_norm). A "YAML
bomb" is refused by the CLI's loader before it is built, and its expansion (20,001 values) and a
submission over FEDMQ_MAX_CLIENTS by the scheduler. The real update of the forged client waits until
the aggregator has refused both forgeries.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from fedmq.common.bus import topology
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import load_job
from fedmq.common.messages import ClientUpdate, JobEvent, JobSubmit, to_wire
from fedmq.common.settings import Settings
from fedmq.common.speclimits import MAX_NODES
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.cli.embedded import run_job
from fedmq.services.scheduler.sampling import sample_clients
from tests.conftest import EmbeddedRuns, assert_bit_identical, shard_size, small_job
from tests.integration import train_plugins
from tests.integration.test_hostile_input import publish_hostile
from tests.rabbit import WatchedBus, fresh_vhost
from tests.unit.test_spec_limits import laughs

pytestmark = pytest.mark.rabbitmq

BOUND = 10.0  # honest updates of this job have norms below 1


Message = tuple[str, bytes, dict]


def forged(job_id: str, digest: str, spec: Any, client: int, true_count: int) -> list[Message]:
    good = TaskRuntime.for_job(spec).build_model().state_dict()
    name = next(iter(good))

    def update(**changes: Any) -> bytes:
        fields: dict[str, Any] = dict(job_id=job_id, task_id="evil", round=2, client=client,
                                      base_digest=digest, num_examples=true_count, weights=dict(good))
        return to_wire(ClientUpdate(**(fields | changes)))

    boosted = {**good, name: good[name] + 100.0}
    return [
        (topology.AGGREGATOR, update(num_examples=1000 * true_count), {}),
        (topology.AGGREGATOR, update(weights=boosted), {}),
    ]


def submissions(spec: Any) -> list[Message]:
    raw = spec.model_dump(mode="json")
    options = {**raw["task"]["options"], "lol": [0] * (MAX_NODES + 1)}
    bomb = {**raw, "task": {**raw["task"], "options": options}}
    crowd = {**raw, "clients": {"total": 1_000}}
    return [(topology.SCHEDULER, to_wire(JobSubmit(job_id=job_id, spec=body)), {})
            for job_id, body in (("bomb", bomb), ("crowd", crowd))]


def test_implausible_updates_and_oversized_jobs_are_refused_counted_and_change_nothing(
    tmp_path: Path, embedded_runs: EmbeddedRuns
) -> None:
    (tmp_path / "bomb.yaml").write_text(laughs(9))
    with pytest.raises(ConfigError, match=f"more than {MAX_NODES} values once its aliases"):
        load_job(tmp_path / "bomb.yaml")  # the CLI refuses it before building anything

    spec = small_job(rounds=3, task__name="tests.integration.train_plugins:Gated",
                     clients__max_update_norm=BOUND)
    undisturbed = embedded_runs.weights(spec)
    client = max(sample_clients(spec.seed, 2, spec.clients.total, spec.clients.sampled))
    assert client in sample_clients(spec.seed, 1, spec.clients.total, spec.clients.sampled)
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path / "state", frame_bytes=64 * 1024,
                            max_clients=100)
        digests: dict[int, str] = {}
        injected = threading.Event()
        refused: list[str] = []
        real_update_may_go = train_plugins.gate(spec.seed, 2, client)

        def on_event(event: JobEvent) -> None:
            if event.kind == "round_completed" and event.round is not None:
                digests[event.round] = event.data["model_digest"]
            if event.kind == "round_started" and event.round == 2 and not injected.is_set():
                injected.set()
                messages = forged(event.job_id, digests[1], spec, client, shard_size(spec, client))
                publish_hostile(url, messages + submissions(spec))

        def aggregator_refused(reason: str) -> None:
            # The real update must come after both forgeries (else they would be duplicates, acked
            # with no effect), and after both broken blobs: each is refused only once the aggregator
            # waited for its missing chunks, which a job that ended sooner would not count.
            refused.append(reason.split(":", 1)[0])
            if {"implausible_examples", "update_norm"} <= set(refused) and refused.count("blob") == 2:
                real_update_may_go.set()

        def connect(name: str) -> RabbitBus:
            if name == "aggregator":
                return WatchedBus(settings, name, aggregator_refused)
            return RabbitBus(settings, name)

        try:
            result = run_job(spec, settings, connect=connect, on_event=on_event, idle_timeout=60)
        finally:
            train_plugins.reset()
    assert injected.is_set()
    assert result["status"] == "completed", result.get("reason")
    assert [h["failed"] for h in result["history"][1:]] == [0, 0, 0], "the gate opened in time"
    assert_bit_identical(load_state(result["model_path"])[0], undisturbed)
    assert result["dead_letters"] == {"implausible_examples": 1, "update_norm": 1, "over_limit": 2, "blob": 2}
    assert result["jobs_refused"] == {"spec_nodes": 1, "max_clients": 1}
