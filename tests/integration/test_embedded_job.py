"""Whole jobs on the in-memory bus: learning, reproducibility, strategies, plug-ins, failures."""

from __future__ import annotations

import json

import pytest
import torch

import fedmq
from fedmq.common.checkpoint import load_state
from fedmq.common.settings import Settings
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.cli.embedded import run_job
from tests.conftest import assert_bit_identical, assert_matches_reference, shard_size, small_job
from tests.integration import train_plugins
from tests.reference import reference_fedavg


def final_weights(result: dict) -> dict[str, torch.Tensor]:
    return load_state(result["model_path"])[0]


def test_a_short_job_improves_accuracy_over_its_initial_model(settings: Settings) -> None:
    result = run_job(small_job(), settings, idle_timeout=60)
    assert result["status"] == "completed"
    assert [h["round"] for h in result["history"]] == [0, 1, 2, 3]
    assert result["final"]["server.accuracy"] > result["initial"]["server.accuracy"] + 0.3


def test_two_runs_of_the_same_spec_give_bit_identical_weights(settings: Settings, tmp_path) -> None:
    first = run_job(small_job(), settings, idle_timeout=60)
    second = run_job(small_job(), Settings(state_dir=tmp_path / "other"), idle_timeout=60)
    assert first["model_digest"] == second["model_digest"]
    assert_bit_identical(final_weights(first), final_weights(second))
    assert [h["metrics"] for h in first["history"]] == [h["metrics"] for h in second["history"]]


def test_fedmq_run_skips_fsync_unless_told_and_the_weights_are_the_same_either_way(
    settings: Settings, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    real, synced = os.fsync, []

    def fsync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    quick = run_job(small_job(rounds=2), settings, idle_timeout=60)
    assert len(synced) == 2  # the final model alone, the user's to keep: the file and its folder
    durable_settings = Settings(state_dir=tmp_path / "durable", fsync=True)
    durable = run_job(small_job(rounds=2), durable_settings, idle_timeout=60)
    assert len(synced) > 10  # every update, checkpoint and record, and the scheduler's commits
    assert quick["model_digest"] == durable["model_digest"]


def test_changing_the_seed_changes_the_final_weights(settings: Settings) -> None:
    a = run_job(small_job(seed=1), settings, idle_timeout=60)
    b = run_job(small_job(seed=2), settings, idle_timeout=60)
    assert a["model_digest"] != b["model_digest"]
    wa, wb = final_weights(a), final_weights(b)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


def test_three_learners_give_the_same_weights_as_one(settings: Settings, tmp_path) -> None:
    # Updates arrive in a different order with three learners; the result must not care.
    spec = small_job(clients__total=9, rounds=2)
    one = run_job(spec, settings, learners=1, idle_timeout=60)
    three = run_job(spec, Settings(state_dir=tmp_path / "three"), learners=3, idle_timeout=60)
    assert one["status"] == three["status"] == "completed"
    assert_bit_identical(final_weights(one), final_weights(three))


@pytest.mark.parametrize(
    "changes",
    [
        {"strategy": {"name": "average"}},
        {"strategy": {"name": "fedavgm", "server_momentum": 0.5}},
        {"task__options__model": {"name": "cnn", "channels": [8]},
         "task__options__partition": {"kind": "shards"}},
        {"task__options__partition": {"kind": "iid"}, "train__optimizer": "adam", "train__lr": 0.01},
    ],
    ids=["average", "fedavgm", "cnn-shards", "iid-adam"],
)
def test_every_strategy_model_and_partition_learns(settings: Settings, changes: dict) -> None:
    result = run_job(small_job(rounds=4, **changes), settings, idle_timeout=60)
    assert result["status"] == "completed"
    assert result["final"]["server.accuracy"] > result["initial"]["server.accuracy"] + 0.2


def test_sampling_trains_only_per_round_clients_each_round(settings: Settings) -> None:
    result = run_job(small_job(clients__total=20, clients__per_round=4), settings, idle_timeout=60)
    assert result["status"] == "completed"
    assert all(h["clients"] == 4 for h in result["history"][1:])


def test_the_saved_model_reloads_and_scores_the_reported_accuracy(settings: Settings) -> None:
    spec = small_job()
    result = run_job(spec, settings, idle_timeout=60)
    model = fedmq.load_model(result["model_path"])
    x, y = TaskRuntime.for_job(spec).load_server_data(None)
    with torch.no_grad():
        accuracy = float((model(x).argmax(dim=1) == y).float().mean())
    assert accuracy == pytest.approx(result["final"]["server.accuracy"], abs=1e-12)


def test_a_users_task_with_its_own_train_runs_end_to_end(settings: Settings) -> None:
    spec = small_job(task={"name": "examples.plugins.my_task:MyTask"}, rounds=5)
    result = run_job(spec, settings, idle_timeout=60)
    assert result["status"] == "completed"
    assert result["final"]["server.accuracy"] > 0.8


def test_a_failing_client_leaves_the_round_to_close_at_quorum(settings: Settings) -> None:
    spec = small_job(
        clients__min_fit=4, clients__on_error="drop_client", rounds=2,
        task__name="tests.integration.train_plugins:Failing",
    )
    train_plugins.FAIL_SIZE[0] = shard_size(spec, 0)
    try:
        result = run_job(spec, settings, idle_timeout=60)
    finally:
        train_plugins.FAIL_SIZE[0] = -1
    assert result["status"] == "completed"
    assert [h["clients"] for h in result["history"][1:]] == [4, 4]
    assert [h["failed"] for h in result["history"][1:]] == [1, 1]


def test_a_round_below_quorum_fails_the_job_with_a_reason(settings: Settings) -> None:
    spec = small_job(
        clients__min_fit=5, clients__on_error="drop_client", max_round_retries=1,
        task__name="tests.integration.train_plugins:Failing",
    )
    train_plugins.FAIL_SIZE[0] = shard_size(spec, 0)
    try:
        result = run_job(spec, settings, idle_timeout=60)
    finally:
        train_plugins.FAIL_SIZE[0] = -1
    assert result["status"] == "failed"
    assert "quorum is 5" in result["reason"]
    assert "simulated out-of-memory" in result["reason"]


@pytest.mark.parametrize("strategy", ["fedavg", "fedavgm"])
def test_the_services_compute_what_a_plain_fedavg_loop_computes(settings: Settings, strategy: str) -> None:
    # Within float error (tests/conftest.py): the loop is written independently, so it adds in
    # another order. Bit-identity between service runs is the business of the tests above.
    spec = small_job(clients__total=8, clients__per_round=5, strategy={"name": strategy})
    result = run_job(spec, settings, idle_timeout=60)
    assert result["status"] == "completed"
    assert_matches_reference(result, reference_fedavg(spec))


def test_a_round_whose_event_was_lost_is_still_in_the_result_from_the_schedulers_record(
    settings: Settings,
) -> None:
    # Events are best effort: on RabbitMQ one published while the follower's connection is being
    # made again is lost. The result's history is the scheduler's, whatever the follower heard.
    from fedmq.common.bus.base import EventHandler
    from fedmq.common.bus.memory import MemoryBroker, MemoryBus
    from fedmq.common.messages import from_wire

    class Deaf(MemoryBus):
        """A follower's bus that never hears round 2 complete."""

        def subscribe(self, pattern: str, handler: EventHandler) -> None:
            def lossy(body: bytes) -> None:
                event = from_wire(body)
                if not (getattr(event, "kind", "") == "round_completed" and getattr(event, "round", 0) == 2):
                    handler(body)

            super().subscribe(pattern, lossy)

    broker = MemoryBroker()
    heard: list[int | None] = []
    spec = small_job(rounds=3)
    result = run_job(
        spec, settings,
        connect=lambda name: Deaf(broker, "cli") if name == "client" else broker.connect(
            name.split("-")[0] if name.split("-")[0] in ("scheduler", "aggregator", "learner") else "cli"),
        on_event=lambda e: heard.append(e.round) if e.kind == "round_completed" else None,
    )
    assert result["status"] == "completed"
    assert heard == [0, 1, 3], "the follower missed round 2"
    assert [h["round"] for h in result["history"]] == [0, 1, 2, 3]
    assert_matches_reference(result, reference_fedavg(spec))


def test_the_aggregator_writes_the_clients_example_counts_only_when_a_client_is_new(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every client reports every round: its first count is kept from round 1 on, and no later
    # round writes (and fsyncs) the same record again.
    from fedmq.services.aggregator.store import JobStore

    saved: list[str] = []
    save_json = JobStore.save_json

    def recording(store: JobStore, name: str, value: dict) -> None:
        saved.append(name)
        save_json(store, name, value)

    monkeypatch.setattr(JobStore, "save_json", recording)
    spec = small_job(rounds=4)
    result = run_job(spec, settings)
    assert result["status"] == "completed"
    assert saved.count("examples") == 1 and saved.count("closed") == 5  # rounds 0 to 4
    stored = settings.state_dir / "aggregator" / result["job_id"] / "examples.json"
    assert json.loads(stored.read_text()) == {str(c): shard_size(spec, c) for c in range(5)}
