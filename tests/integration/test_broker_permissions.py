"""deploy/rabbitmq's rights on a live broker: who may send what.

The definitions are imported into a private vhost (tests/rabbit.py: deployed_vhost). Each
forbidden publish is refused by RabbitMQ itself: 403 for a destination the user may not
write (through its exchange or the default one), 406 for a forged `user_id`. What a user may
publish there but not in its role (a learner's round control, the CLI's forged receipts, an
update without `user_id`) is refused by the service that receives it and counted as "sender".
A job run meanwhile by the services, each as its own user, ends with the undisturbed weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
import torch

from fedmq.common.bus import topology
from fedmq.common.bus.factory import user_of
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import (
    ClientFailure,
    ClientUpdate,
    JobEvent,
    RoundClose,
    TrainTask,
    UpdateAccepted,
    to_wire,
)
from fedmq.common.settings import Settings
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.cli.embedded import run_job
from fedmq.services.scheduler.sampling import sample_clients
from tests.conftest import EmbeddedRuns, assert_bit_identical, small_job
from tests.integration import train_plugins
from tests.rabbit import Deployed, WatchedBus, deployed_vhost

pytestmark = pytest.mark.rabbitmq

AGGREGATOR_X = topology.exchange_for(topology.AGGREGATOR)


def forged_update(job_id: str, digest: str, spec: JobSpec, client: int, server_round: int) -> bytes:
    """A well-formed update that would win its client's place in the round: huge weights and count."""
    good = TaskRuntime.for_job(spec).build_model().state_dict()
    weights = {name: torch.full_like(tensor, 1e30) for name, tensor in good.items()}
    return to_wire(ClientUpdate(job_id=job_id, task_id="evil", round=server_round, client=client,
                                base_digest=digest, num_examples=10**6, weights=weights))


def publish(deployed: Deployed, user: str, exchange: str, key: str, body: bytes, **props: Any) -> None:
    """Publish as `user`, waiting for the broker's answer (a refusal raises ChannelClosedByBroker)."""
    conn = pika.BlockingConnection(pika.URLParameters(deployed.url(user)))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish(exchange, key, body, pika.BasicProperties(**props), mandatory=True)
    finally:
        if conn.is_open:
            conn.close()


def refused_by_broker(deployed: Deployed, operation: Callable[[Any], object], user: str) -> int:
    """The reply code the broker closes the channel with when `user` tries `operation`."""
    conn = pika.BlockingConnection(pika.URLParameters(deployed.url(user)))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            operation(ch)
        return int(info.value.reply_code)
    finally:
        if conn.is_open:
            conn.close()


def test_the_broker_refuses_each_publish_outside_a_users_rights() -> None:
    task = to_wire(TrainTask(job_id="j", task_id="t", round=1, client=0, model_digest="d", spec={}))
    update = to_wire(ClientUpdate(job_id="j", task_id="t", round=1, client=0, base_digest="d",
                                  num_examples=1, weights={"w": torch.zeros(1)}))
    with deployed_vhost() as deployed:
        names = deployed.names

        def send(exchange: str, key: str, body: bytes, **props: Any) -> Callable[[Any], object]:
            properties = pika.BasicProperties(**props)
            return lambda ch: ch.basic_publish(exchange, key, body, properties, mandatory=True)

        def bind(queue: str, exchange: str) -> Callable[[Any], object]:
            return lambda ch: ch.queue_bind(queue, exchange, routing_key=queue)

        def bind_own(exchange: str, key: str) -> Callable[[Any], object]:
            def go(ch: Any) -> None:
                own = ch.queue_declare("", exclusive=True).method.queue
                ch.queue_bind(own, exchange, routing_key=key)
            return go

        cases = {
            # the CLI forging updates or tasks, through the default exchange and through the named ones
            "cli update, default exchange": ("cli", send("", topology.AGGREGATOR, update), 403),
            "cli update, aggregator exchange": ("cli", send(AGGREGATOR_X, topology.AGGREGATOR, update), 403),
            "cli task, default exchange": ("cli", send("", topology.TASKS, task), 403),
            "cli task, tasks exchange": ("cli", send("fedmq.x.tasks", topology.TASKS, task), 403),
            # round control and tasks are the scheduler's
            "learner task": ("learner", send("fedmq.x.tasks", topology.TASKS, task), 403),
            "learner task, default exchange": ("learner", send("", topology.TASKS, task), 403),
            "aggregator task": ("aggregator", send("fedmq.x.tasks", topology.TASKS, task), 403),
            "learner update, default exchange": ("learner", send("", topology.AGGREGATOR, update), 403),
            # answering another's request is the scheduler's and the aggregator's
            "learner reply": ("learner", send(topology.REPLIES, "amq.gen-x", b"{}"), 403),
            # routing around the exchanges: a work queue bound elsewhere, or read through one's own queue
            "cli binds the aggregator's queue": ("cli", bind(topology.AGGREGATOR, "fedmq.x.scheduler"), 403),
            "learner binds the tasks queue": ("learner", bind(topology.TASKS, "fedmq.x.aggregator"), 403),
            "cli taps the tasks": ("cli", bind_own("fedmq.x.tasks", topology.TASKS), 403),
            "learner taps the dead letters": ("learner", bind_own(topology.DLX, "#"), 403),
            # a forged sender: RabbitMQ checks user_id against the login
            "cli as the scheduler": ("cli", send("fedmq.x.scheduler", topology.SCHEDULER, b"{}",
                                                 user_id=names["scheduler"]), 406),
            "learner as the scheduler": ("learner", send("fedmq.x.aggregator", topology.AGGREGATOR, b"{}",
                                                         user_id=names["scheduler"]), 406),
            "cli as a learner": ("cli", send("fedmq.x.scheduler", topology.SCHEDULER, b"{}",
                                             user_id=names["learner"]), 406),
        }
        codes = {case: refused_by_broker(deployed, op, user) for case, (user, op, _) in cases.items()}
        # What each user may do still goes through (the same helper, so the refusals above are the rights).
        publish(deployed, "learner", "fedmq.x.aggregator", topology.AGGREGATOR, b"", user_id=names["learner"])
        publish(deployed, "cli", "fedmq.x.scheduler", topology.SCHEDULER, b"", user_id=names["cli"])
        publish(deployed, "scheduler", "fedmq.x.tasks", topology.TASKS, b"", user_id=names["scheduler"])
    assert codes == {case: code for case, (_, _, code) in cases.items()}


def test_messages_outside_a_senders_role_are_refused_counted_and_change_nothing(
    tmp_path: Path, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(rounds=3, task__name="tests.integration.train_plugins:Gated")
    undisturbed = embedded_runs.weights(spec)
    victim = max(sample_clients(spec.seed, 2, spec.clients.total, spec.clients.sampled))
    with deployed_vhost() as deployed:
        names = deployed.names
        settings = Settings(  # a frame below the model's size: models and updates travel as blobs
            state_dir=tmp_path, frame_bytes=64 * 1024, scheduler_users=names["scheduler"],
            aggregator_users=names["aggregator"], learner_users=names["learner"], cli_users=names["cli"],
        )
        digests: dict[int, str] = {}
        injected = threading.Event()
        refused: list[str] = []
        forged = 4
        real_update_may_go = train_plugins.gate(spec.seed, 2, victim)  # the forged messages land first

        def on_event(event: JobEvent) -> None:
            if event.kind == "round_completed" and event.round is not None:
                digests[event.round] = event.data["model_digest"]
            if event.kind != "round_started" or event.round != 2 or injected.is_set():
                return
            injected.set()
            job = event.job_id
            learner, cli = names["learner"], names["cli"]
            # A learner may write to the aggregator, but round control is the scheduler's...
            close = RoundClose(job_id=job, round=2, clients=[victim])
            publish(deployed, "learner", AGGREGATOR_X, topology.AGGREGATOR, to_wire(close), user_id=learner)
            # ...and an update must say who sent it (RabbitMQ checks user_id only when it is there).
            update = forged_update(job, digests[1], spec, victim, 2)
            publish(deployed, "learner", "fedmq.x.aggregator", topology.AGGREGATOR, update)
            # The CLI may write to the scheduler; receipts and failures are the aggregator's and learners'.
            accepted = UpdateAccepted(job_id=job, round=2, client=victim, num_examples=10**6)
            publish(deployed, "cli", "fedmq.x.scheduler", topology.SCHEDULER, to_wire(accepted), user_id=cli)
            failure = ClientFailure(job_id=job, task_id="evil", round=2, client=victim, code="error",
                                    reason="forged")
            publish(deployed, "cli", "fedmq.x.scheduler", topology.SCHEDULER, to_wire(failure), user_id=cli)

        def seen(reason: str) -> None:
            refused.append(reason)
            if len(refused) == forged:
                real_update_may_go.set()

        def connect(name: str) -> RabbitBus:
            bus_settings = settings.model_copy(update={"broker_url": deployed.url(user_of(name))})
            if name in ("scheduler", "aggregator"):
                return WatchedBus(bus_settings, name, seen)
            return RabbitBus(bus_settings, name)

        try:
            result = run_job(spec, settings, connect=connect, on_event=on_event, idle_timeout=90)
        finally:
            train_plugins.reset()
    assert injected.is_set()
    assert result["status"] == "completed", result
    assert [h["failed"] for h in result["history"][1:]] == [0, 0, 0]
    assert [reason.split(":", 1)[0] for reason in refused] == ["sender"] * forged
    assert result["dead_letters"] == {"sender": forged}
    assert_bit_identical(load_state(result["model_path"])[0], undisturbed)
