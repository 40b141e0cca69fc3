"""Hostile input published straight to the queues: each piece is refused with its reason and
counted, and the job in progress finishes with exactly the weights it would have had.

The crafted updates name a real client of the round in progress; that client's own training
waits until the aggregator has refused every crafted message, so they land first by design.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pika
import pytest
import torch

from fedmq.common.bus import topology
from fedmq.common.bus.base import Body
from fedmq.common.bus.blob import H_BLOB, H_COUNT, H_DIGEST, H_INDEX, H_SIZE
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import ClientUpdate, JobEvent, from_wire, to_wire
from fedmq.common.settings import Settings
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.cli.embedded import run_job
from fedmq.services.scheduler.sampling import sample_clients
from tests.conftest import EmbeddedRuns, assert_bit_identical, assert_matches_reference, small_job
from tests.integration import train_plugins
from tests.rabbit import WatchedBus, fresh_vhost
from tests.reference import reference_fedavg

pytestmark = pytest.mark.rabbitmq  # every test here talks to a real broker


class DoublingBus(RabbitBus):
    """A learner's bus that sends round 2's updates twice, as a redelivery storm would: all but the
    gated client's, the round's last. A copy of a round's last update can trail the RoundClose it
    led to and be refused as stale (the broker's right): one refusal more than this test counts."""

    gated_client = -1

    def publish(self, queue: str, body: Body, **kwargs: Any) -> None:
        super().publish(queue, body, **kwargs)
        msg = from_wire(body) if queue == topology.AGGREGATOR else None
        if isinstance(msg, ClientUpdate) and msg.round == 2 and msg.client != self.gated_client:
            super().publish(queue, body, **kwargs)


# What reaches the aggregator's queue: 10 crafted messages and the envelopes of 2 broken blobs.
TO_AGGREGATOR = 12


def hostile_messages(job_id: str, digest: str, spec: JobSpec, client: int) -> list[tuple[str, bytes, dict]]:
    good = TaskRuntime.for_job(spec).build_model().state_dict()
    name = next(iter(good))

    def update(**changes: Any) -> bytes:
        fields: dict[str, Any] = dict(job_id=job_id, task_id="evil", round=2, client=client,
                                      base_digest=digest, num_examples=10, weights=dict(good))
        fields.update(changes)
        return to_wire(ClientUpdate(**fields))

    wrong_shape = {**good, name: torch.zeros(3, 3)}
    with_nan = {**good, name: torch.full_like(good[name], float("nan"))}
    valid = update()
    return [
        (topology.AGGREGATOR, b"\x00garbage\xff" * 10, {}),
        (topology.AGGREGATOR, valid[: len(valid) // 2], {}),
        (topology.AGGREGATOR, to_wire_raw({"v": 2, "type": "client_update", "job_id": job_id}), {}),
        (topology.AGGREGATOR, update(weights=wrong_shape), {}),
        (topology.AGGREGATOR, update(weights=with_nan), {}),
        (topology.AGGREGATOR, update(num_examples=-5), {}),
        (topology.AGGREGATOR, update(extras={"delta": torch.zeros(2), "bad name": torch.zeros(1)}), {}),
        (topology.AGGREGATOR, update(job_id="no-such-job"), {}),
        (topology.AGGREGATOR, update(round=1), {}),
        (topology.AGGREGATOR, b"x" * (65 * 1024), {}),  # over the 64 KiB frame, not chunked
        (topology.SCHEDULER, b"\x92\x01garbage", {}),
        (topology.TASKS, b"\xc1", {}),
    ]


def to_wire_raw(value: dict[str, Any]) -> bytes:
    from fedmq.common import codec

    return codec.packb(value)


def publish_hostile(url: str, messages: list[tuple[str, bytes, dict]]) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    user = urlsplit(url).username  # a user the services take updates from: the checks after that one run
    for queue, body, headers in messages:
        ch.basic_publish("", queue, body, pika.BasicProperties(headers=headers or None, user_id=user))
    # A chunk stream that never completes, and one that claims more than the limit.
    ch.queue_declare("fedmq.blob.evil", durable=True, arguments={"x-expires": 60_000})
    ch.basic_publish("", "fedmq.blob.evil", b"a" * 10,
                     pika.BasicProperties(headers={H_BLOB: "fedmq.blob.evil", H_INDEX: 0, H_COUNT: 2}))
    digest = hashlib.sha256(b"a" * 20).hexdigest()
    for size in (20, 10 * 1024**3):
        ch.basic_publish("", topology.AGGREGATOR, b"", pika.BasicProperties(user_id=user, headers={
            H_BLOB: "fedmq.blob.evil", H_COUNT: 2, H_SIZE: size, H_DIGEST: digest}))
    conn.close()


def test_hostile_input_is_refused_counted_and_changes_nothing(
    tmp_path: Path, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(rounds=3, task__name="tests.integration.train_plugins:Gated")
    undisturbed = embedded_runs.weights(spec)
    last_client = max(sample_clients(spec.seed, 2, spec.clients.total, spec.clients.sampled))
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=64 * 1024)
        digests: dict[int, str] = {}
        injected = threading.Event()
        # The real update for the client the crafted ones name waits until all were refused.
        refused: list[str] = []
        real_update_may_go = train_plugins.gate(spec.seed, 2, last_client)

        class Doubling(DoublingBus):
            gated_client = last_client

        def on_event(event: JobEvent) -> None:
            if event.kind == "round_completed" and event.round is not None:
                digests[event.round] = event.data["model_digest"]
            if event.kind == "round_started" and event.round == 2 and not injected.is_set():
                injected.set()
                messages = hostile_messages(event.job_id, digests[1], spec, last_client)
                assert sum(queue == topology.AGGREGATOR for queue, _, _ in messages) + 2 == TO_AGGREGATOR
                publish_hostile(url, messages)

        def aggregator_refused(reason: str) -> None:
            refused.append(reason)
            if len(refused) == TO_AGGREGATOR:
                real_update_may_go.set()

        def connect(name: str) -> RabbitBus:
            if name == "aggregator":
                return WatchedBus(settings, name, aggregator_refused)
            return (Doubling if name.startswith("learner") else RabbitBus)(settings, name)

        try:
            result = run_job(spec, settings, connect=connect, on_event=on_event, idle_timeout=60)
        finally:
            train_plugins.reset()
    assert injected.is_set()
    assert result["status"] == "completed"
    assert [h["failed"] for h in result["history"][1:]] == [0, 0, 0], "the gate opened in time"
    assert len(refused) == TO_AGGREGATOR
    assert_bit_identical(load_state(result["model_path"])[0], undisturbed)
    assert_matches_reference(result, reference_fedavg(spec))
    assert result["dead_letters"] == {
        "decode": 5,  # garbage, truncated, wrong schema (aggregator); scheduler; learner
        "wrong_shape": 1, "non_finite": 1, "bad_example_count": 1, "wrong_extras": 1, "unknown_job": 1,
        "stale_round": 1, "oversize": 1, "blob": 2,
    }
