"""Whole jobs through the services on the in-memory bus and on RabbitMQ: same scenarios, same answers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pika.exceptions
import pytest

from fedmq.common.bus.base import Body
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.messages import JobEvent, RoundClosed, RoundOpen, from_wire
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import EmbeddedRuns, assert_bit_identical, assert_matches_reference, shard_size, small_job
from tests.integration import train_plugins
from tests.integration.conftest import Transport
from tests.rabbit import fresh_vhost
from tests.reference import reference_fedavg


@pytest.mark.parametrize("learners", [1, 3])
def test_a_job_gives_the_reference_weights_on_either_bus(
    transport: Transport, learners: int, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(clients__total=9, clients__per_round=6, rounds=3)
    result = run_job(spec, transport.settings, learners=learners, connect=transport.connect,
                     idle_timeout=60)
    assert result["status"] == "completed"
    # Bit for bit what one learner on the in-memory bus computes; FedAvg within float error.
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))
    assert_matches_reference(result, reference_fedavg(spec))


USER_STRATEGY = {
    "task__name": "tests.support.strategies:CountingDigits",
    "strategy": {"name": "tests.support.strategies:Counting"},
    "clients__total": 6, "clients__per_round": 4,
}


@pytest.mark.parametrize("learners", [1, 3])
@pytest.mark.parametrize(
    "changes", [
        USER_STRATEGY, {"strategy": {"name": "fedprox", "options": {"mu": 0.5}}},
        {"strategy": {"name": "scaffold"}, "clients__total": 6, "clients__per_round": 4},
    ],
    ids=["user-strategy-with-client-state", "fedprox", "scaffold-shared-and-client-state"],
)
def test_a_strategy_with_round_config_and_client_state_gives_the_same_weights_on_either_bus(
    transport: Transport, learners: int, changes: dict[str, Any], embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(rounds=3, **changes)
    result = run_job(spec, transport.settings, learners=learners, connect=transport.connect,
                     idle_timeout=60)
    assert result["status"] == "completed", result.get("reason")
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))
    if "mismatched" in result["history"][-1]["metrics"].get("strategy", {}):
        assert [h["metrics"]["strategy"]["mismatched"] for h in result["history"][1:]] == [0.0] * 3


def test_global_weights_cross_the_bus_once_per_learner_per_round(transport: Transport) -> None:
    spec = small_job(clients__total=12, rounds=3)
    fetched = Settings(**{**transport.settings.model_dump(), "push_model_bytes": 0})  # none sent with tasks
    result = run_job(spec, fetched, learners=3, connect=transport.connect, idle_timeout=60)
    assert result["status"] == "completed"
    fetches = result["model_fetches"]
    assert all(f <= spec.rounds for f in fetches), fetches
    assert sum(fetches) >= spec.rounds


def test_a_failing_client_is_reported_and_the_round_closes_at_quorum(transport: Transport) -> None:
    failing = "tests.integration.train_plugins:Failing"
    spec = small_job(clients__min_fit=4, clients__on_error="drop_client", rounds=2, task__name=failing)
    train_plugins.FAIL_SIZE[0] = shard_size(spec, 0)
    try:
        result = run_job(spec, transport.settings, connect=transport.connect, idle_timeout=60)
    finally:
        train_plugins.FAIL_SIZE[0] = -1
    assert result["status"] == "completed"
    assert [(h["clients"], h["failed"]) for h in result["history"][1:]] == [(4, 1), (4, 1)]


@pytest.mark.rabbitmq
def test_training_longer_than_three_heartbeats_keeps_the_connection(tmp_path) -> None:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, heartbeat_s=1)
        spec = small_job(clients__total=2, rounds=1, task__name="tests.integration.train_plugins:Slow")
        train_plugins.SECONDS[0] = 4.0  # > 3 heartbeat intervals of 1 s, per task
        try:
            result = run_job(spec, settings, connect=lambda name: RabbitBus(settings, name),
                             idle_timeout=60)
        finally:
            train_plugins.SECONDS[0] = 0.0
    assert result["status"] == "completed"
    assert result["reconnects"] == 0
    assert result["tasks_redelivered"] == 0


def test_a_task_missing_near_the_deadline_is_sent_again_and_the_round_keeps_every_client(
    transport: Transport, embedded_runs: EmbeddedRuns,
) -> None:
    spec = small_job(rounds=2, round_timeout_s=3, task__name="tests.integration.train_plugins:Gated")
    undisturbed = embedded_runs.weights(spec)  # before the gate: this run must not wait on it
    # The first attempt at client 0's round 1 hangs until that round has closed without it.
    hung = train_plugins.gate(spec.seed, 1, 0)

    def on_event(event: JobEvent) -> None:
        if event.kind == "round_completed" and event.round == 1:
            hung.set()

    try:
        result = run_job(spec, transport.settings, learners=2, connect=transport.connect,
                         on_event=on_event, idle_timeout=60)
    finally:
        train_plugins.reset()
    assert result["status"] == "completed"
    first = result["history"][1]
    assert (first["clients"], first["failed"]) == (5, 0), "the re-sent task, not the deadline, closed it"
    assert first["seconds"] < spec.round_timeout_s
    # the hung attempt's update arrives later and changes nothing
    assert_bit_identical(load_state(result["model_path"])[0], undisturbed)
    assert_matches_reference(result, reference_fedavg(spec))


@pytest.mark.rabbitmq
@pytest.mark.parametrize(("service", "lost"), [("scheduler", RoundOpen), ("aggregator", RoundClosed)])
def test_a_publish_the_broker_cut_off_is_made_again_when_the_message_that_led_to_it_comes_again(
    tmp_path: Path, embedded_runs: EmbeddedRuns, service: str, lost: type[RoundOpen | RoundClosed]
) -> None:
    # RoundOpen, found by the chaos test: the scheduler recorded round 1, then lost the broker while
    # it opened round 2; the RoundClosed that came again was taken for a duplicate and the job
    # stalled. RoundClosed: the aggregator closed round 2 itself once every update was stored, then
    # lost the broker as the announcement and the RoundClosed went out. The update that comes again
    # must bring the RoundClosed again (the scheduler takes it: it folds every client), else the
    # round would wait for its deadline (600 s here: the job would not finish within the idle timeout).
    spec = small_job(rounds=3, round_timeout_s=600)
    failed: list[int] = []
    cut_with: list[str] = []  # the types published with the one cut off

    class LosesTheBrokerOnce(RabbitBus):
        def publish(self, queue: str, body: Body, **kwargs: Any) -> None:
            self._cut(body, [])
            super().publish(queue, body, **kwargs)

        def publish_all(self, messages: Sequence[tuple[str, bytes]]) -> None:  # a round's RoundOpen and tasks
            for _, body in messages:
                self._cut(body, [from_wire(other).type for _, other in messages])  # type: ignore[attr-defined]
            super().publish_all(messages)

        def _cut(self, body: Body, batch: list[str]) -> None:
            msg = from_wire(body)
            if isinstance(msg, lost) and msg.round == 2 and not failed:
                failed.append(msg.round)
                cut_with.extend(batch)
                raise pika.exceptions.StreamLostError("the broker closed the connection")

    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, log_format="json")

        def connect(name: str) -> RabbitBus:
            return (LosesTheBrokerOnce if name == service else RabbitBus)(settings, name)

        result = run_job(spec, settings, connect=connect, idle_timeout=30)
    assert failed == [2] and result["status"] == "completed"
    assert [h["round"] for h in result["history"]] == [0, 1, 2, 3]
    if lost is RoundClosed:  # the aggregator's own close, its announcement lost with it
        assert "updates_accepted" in cut_with, cut_with
        assert (result["history"][2]["clients"], result["history"][2]["failed"]) == (spec.clients.sampled, 0)
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))
