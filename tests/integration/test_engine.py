"""The in-process engine against the services: the same job ends with the same bits, round by round.

Each scenario runs once on the engine and once on the services (the in-memory bus and a real
RabbitMQ), with the same torch thread count: every round's model digest and the final weights
must be equal. Then the engine's own checkpoints: a stop or a crash, and a resume, end where an
undisturbed run ends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from fedmq.common.checkpoint import load_state
from fedmq.common.codec.updates import STATE
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import JobEvent
from fedmq.common.settings import Settings
from fedmq.common.strategy.clients import ClientStore
from fedmq.common.task.runtime import TaskRuntime
from fedmq.common.task.sealing import SEALED
from fedmq.services.aggregator.jobs import RESIDUALS
from fedmq.services.cli.embedded import run_job as on_services
from fedmq.services.engine.engine import Engine
from fedmq.services.engine.run import run_job
from fedmq.services.scheduler.sampling import sample_clients
from tests.conftest import assert_bit_identical, shard_size, small_job
from tests.integration import train_plugins
from tests.integration.conftest import Transport

THREADS = max(1, (os.cpu_count() or 1) // 2)  # what a one-learner embedded cluster gives torch here

SCENARIOS: dict[str, dict[str, Any]] = {
    "fedavg-unfused": {"train__fuse": False},
    "fedavg-fused": {"clients__total": 8, "clients__per_round": 5},
    "topk-with-residuals": {"compression": {"codec": "topk", "fraction": 0.1}, "clients__per_round": 3},
    "int8": {"compression": {"codec": "int8"}},
    "scaffold-client-state": {"strategy": {"name": "scaffold"}, "clients__total": 6, "clients__per_round": 4},
    "federated-evaluation": {"evaluate": {"every": 2, "federated": {"clients": 3}}, "rounds": 4},
    "dp-sgd": {"train__dp_sgd": {"clip_norm": 1.0, "noise_multiplier": 0.5}},
    "updates-clipped": {"clients__max_update_norm": 0.5, "clients__on_large_update": "clip"},
    "optimizer-state-kept": {
        "train__optimizer": "adam", "train__lr": 0.01, "train__keep_optimizer_state": True,
        "clients__per_round": 3, "rounds": 4},
    "fedper": {"personalize": {"method": "fedper", "layers": ["3.*"]}, "clients__per_round": 3, "rounds": 4,
               "evaluate": {"every": 2, "federated": {"clients": 4}}},
    "ditto": {"personalize": {"method": "ditto", "lam": 0.5}, "clients__per_round": 3, "rounds": 4,
              "evaluate": {"every": 2, "federated": {"clients": 4}}},
    "batchnorm-cnn-fused": {  # each client's running statistics stacked; a learner trains each alone
        "task__options": {"model": {"name": "cnn", "channels": [4, 8], "batch_norm": True},
                          "partition": {"kind": "iid"}},  # no batch of one, which BatchNorm refuses
        "clients__total": 8, "clients__per_round": 5},
}


def digests(result: dict[str, Any]) -> list[str]:
    return [h["model_digest"] for h in result["history"]]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_engine_ends_every_round_with_the_services_model(
    transport: Transport, scenario: str, tmp_path: Path
) -> None:
    spec = small_job(**SCENARIOS[scenario])
    key = SecretStr("test-key")  # DP-SGD's noise: the same secret on the learners and in the engine
    # The learners seal client state (the engine keeps it in memory): sealing changes no bit.
    sealed = SecretStr("the learners state key")
    learners = {"torch_threads": THREADS, "dp_key": key, "state_key": sealed}
    services = on_services(spec, transport.settings.model_copy(update=learners), connect=transport.connect,
                           idle_timeout=60)
    engine = run_job(spec, Settings(state_dir=tmp_path / "engine", torch_threads=THREADS, dp_key=key))
    assert services["status"] == engine["status"] == "completed", (
        services.get("reason"), engine.get("reason"))
    assert digests(engine) == digests(services)
    if scenario.endswith("-fused"):
        assert engine["fused_groups"], "the engine trained the round's clients together"
    assert_bit_identical(load_state(engine["model_path"])[0], load_state(services["model_path"])[0])
    for source in ("federated", "personal"):
        assert [h["metrics"].get(source) for h in engine["history"]] == [
            h["metrics"].get(source) for h in services["history"]], source
    if "personalize" in SCENARIOS[scenario]:
        assert any(h["metrics"].get("personal") for h in engine["history"]), "personal models were evaluated"
    if "personalize" in SCENARIOS[scenario] or scenario == "optimizer-state-kept":
        kept = aggregator_client_state(Path(transport.settings.state_dir), spec.clients.total)
        assert kept and all(list(entries) == [SEALED] for entries in kept.values()), kept


def aggregator_client_state(state_dir: Path, clients: int) -> dict[int, dict[str, Any]]:
    """What the aggregator keeps of each client's Task state (fedmq.state.*), as stored on its disk."""
    found: dict[int, dict[str, Any]] = {}
    for folder in state_dir.rglob(RESIDUALS):
        store = ClientStore(folder)
        for client in range(clients):
            entries = {k: v for k, v in store.read(client, before=10**6).items() if k.startswith(STATE)}
            if entries:
                found[client] = entries
    return found


def test_a_failing_client_costs_the_quorum_in_the_engine_as_on_the_services(tmp_path: Path) -> None:
    failing = "tests.integration.train_plugins:Failing"
    spec = small_job(clients__min_fit=4, clients__on_error="drop_client", rounds=2, task__name=failing)
    train_plugins.FAIL_SIZE[0] = shard_size(spec, 0)
    try:
        services = on_services(spec, Settings(state_dir=tmp_path / "s", torch_threads=THREADS),
                               idle_timeout=60)
        engine = run_job(spec, Settings(state_dir=tmp_path / "e", torch_threads=THREADS))
    finally:
        train_plugins.FAIL_SIZE[0] = -1
    assert engine["status"] == "completed"
    assert [h["failed"] for h in engine["history"]] == [h["failed"] for h in services["history"]] == [0, 1, 1]
    assert digests(engine) == digests(services)
    # Each round's record names the client and its phase alike on both (`fedmq console` shows them).
    named = [[(f["client"], f["phase"]) for f in h.get("failures", [])] for h in engine["history"]]
    assert named == [[(f["client"], f["phase"]) for f in h.get("failures", [])] for h in services["history"]]
    assert named == [[], [(0, "train")], [(0, "train")]]
    for result in (engine, services):  # the reason says what the user's code raised, and where
        reasons = [f["reason"] for h in result["history"] for f in h.get("failures", [])]
        assert all("RuntimeError: simulated out-of-memory" in r for r in reasons), reasons


def test_a_client_that_fails_the_job_fails_it_naming_the_client_and_round(tmp_path: Path) -> None:
    spec = small_job(task__name="tests.integration.train_plugins:Broken", rounds=2)
    result = run_job(spec, Settings(state_dir=tmp_path))
    assert result["status"] == "failed"
    assert "user code failed in learner train (round 1, client 0" in result["reason"]
    assert "simulated out-of-memory in every client" in result["reason"]
    assert result["error"]["phase"] == "train"


def test_a_job_that_loses_its_quorum_fails_after_its_retries(tmp_path: Path) -> None:
    spec = small_job(task__name="tests.integration.train_plugins:Broken", clients__on_error="drop_client",
                     max_round_retries=1)
    result = run_job(spec, Settings(state_dir=tmp_path))
    assert result["status"] == "failed"
    assert result["reason"].startswith("round 1: 0 of 5 clients reported, quorum is 5")


class Stopper:
    """Events for an engine: `interrupt()` it (as Ctrl-C does) or crash it after round `at`."""

    def __init__(self, at: int, crash: bool) -> None:
        self.at, self.crash = at, crash
        self.engine: Engine | None = None

    def __call__(self, event: JobEvent) -> None:
        if event.kind == "round_completed" and event.round == self.at:
            if self.crash:
                raise RuntimeError("the process died here")
            assert self.engine is not None
            self.engine.interrupt()

    def attach(self, engine: Engine) -> None:
        self.engine = engine


RESUMED: dict[str, dict[str, Any]] = {
    "fedadam": {"strategy": {"name": "fedadam"}},
    "scaffold": {"strategy": {"name": "scaffold"}},
    "optimizer-state-kept": {
        "train__optimizer": "adam", "train__lr": 0.01, "train__keep_optimizer_state": True},
}


@pytest.mark.parametrize(("stop", "at"), [("interrupt", 3), ("crash", 5)])
@pytest.mark.parametrize("case", sorted(RESUMED))
def test_a_stopped_or_crashed_engine_resumes_from_its_checkpoint_to_the_same_weights(
    tmp_path: Path, stop: str, at: int, case: str
) -> None:
    """A strategy with state of its own (FedAdam's moments), per-client state (SCAFFOLD's controls),
    each client's own optimizer state; topk's residuals in all."""
    spec = small_job(rounds=7, clients__total=6, clients__per_round=4,
                     compression={"codec": "topk", "fraction": 0.2}, **RESUMED[case])
    whole = run_job(spec, Settings(state_dir=tmp_path / "whole"))
    settings = Settings(state_dir=tmp_path / "stopped", checkpoint_every=2)
    stopper = Stopper(at, crash=stop == "crash")
    if stop == "crash":
        with pytest.raises(RuntimeError, match="died here"):
            run_job(spec, settings, job_id="job-1", on_event=stopper, on_engine=stopper.attach)
    else:
        stopped = run_job(spec, settings, job_id="job-1", on_event=stopper, on_engine=stopper.attach)
        assert stopped["status"] == "stopped" and stopped["round"] == at
    told: list[int | None] = []
    resumed = run_job(spec, settings, job_id="job-1", resume=True,
                      on_event=lambda e: told.append(e.round) if e.kind == "round_completed" else None)
    assert resumed["status"] == "completed", resumed.get("reason")
    # A stop checkpoints the round it ends; a crash goes back to the last checkpoint (every 2 rounds).
    checkpointed = at if stop == "interrupt" else at - at % 2
    assert told == list(range(spec.rounds + 1)), "the rounds before the checkpoint told again, then the rest"
    assert digests(resumed) == digests(whole)
    assert_bit_identical(load_state(resumed["model_path"])[0], load_state(whole["model_path"])[0])
    assert checkpointed in {int(r) for r in load_rounds(tmp_path / "stopped", "job-1")}


def load_rounds(state: Path, job_id: str) -> dict[str, str]:
    import json

    return dict(json.loads((state / "engine" / job_id / "rounds.json").read_text()))


def test_the_best_round_is_kept_whatever_the_checkpoints(tmp_path: Path) -> None:
    spec: JobSpec = small_job(rounds=5, objective={"metric": "server.loss", "mode": "min"})
    import fedmq

    result = fedmq.run(spec, state_dir=tmp_path)
    assert result.ok and result.best is not None
    best = result.best_model()
    assert sum(p.numel() for p in best.parameters()) > 0
    with pytest.raises(LookupError, match="FEDMQ_CHECKPOINT_EVERY"):
        result.weights(1 if result.best["round"] != 1 else 2)


def test_an_update_the_checks_refuse_leaves_its_client_silent_in_the_engine_as_on_the_services(
    tmp_path: Path,
) -> None:
    """On the services a refused update is dead-lettered unannounced: its client misses the round's
    deadline. The engine closes the round as the deadline would, with the same clients and failures."""
    spec = small_job(rounds=2, clients__max_update_norm=1.0, clients__on_large_update="reject",
                     clients__min_fit=1, round_timeout_s=3)
    services = on_services(spec, Settings(state_dir=tmp_path / "s", torch_threads=THREADS),
                           idle_timeout=60)
    engine = run_job(spec, Settings(state_dir=tmp_path / "e", torch_threads=THREADS))
    assert engine["status"] == services["status"] == "completed", (
        engine.get("reason"), services.get("reason"))
    rows = [(h["clients"], h["failed"]) for h in engine["history"]]
    assert rows == [(h["clients"], h["failed"]) for h in services["history"]]
    assert any(0 < clients < 5 for clients, _ in rows[1:]), f"some updates must be refused: {rows}"
    assert engine["updates_rejected"] == {"update_norm": 5 * 2 - sum(c for c, _ in rows)}
    assert digests(engine) == digests(services)


@pytest.mark.parametrize(("changes", "said"), [
    ({}, []),
    ({"train__fuse": False}, []),
    ({"task__name": "tests.integration.train_plugins:Slow"}, ["its Task trains with its own train()"]),
    ({"strategy": {"name": "scaffold"}}, ["keeps state per client"]),
], ids=["fused", "asked-unfused", "own-train", "client-state"])
def test_a_job_whose_clients_cannot_train_together_is_told_why_once(
    tmp_path: Path, changes: dict[str, Any], said: list[str]
) -> None:
    notes: list[str] = []
    result = run_job(small_job(rounds=3, **changes), Settings(state_dir=tmp_path), on_notice=notes.append)
    assert result["status"] == "completed"
    assert len(notes) == len(said) and all(s in n for s, n in zip(said, notes, strict=True)), notes
    assert bool(result["fused_groups"]) == (not changes)


def test_a_clients_own_state_comes_back_to_it_each_time_it_trains_on_both_engines(
    transport: Transport, tmp_path: Path
) -> None:
    """Visits counts each client's trainings in its state: a round's most is what sampling says."""
    spec = small_job(task__name="tests.integration.train_plugins:Visits", clients__total=5,
                     clients__per_round=2, rounds=6, train__momentum=0.9, train__keep_optimizer_state=True)
    services = on_services(spec, transport.settings.model_copy(update={"torch_threads": THREADS}),
                           connect=transport.connect, idle_timeout=60)
    engine = run_job(spec, Settings(state_dir=tmp_path, torch_threads=THREADS))
    assert services["status"] == engine["status"] == "completed", (
        services.get("reason"), engine.get("reason"))
    visits: dict[int, int] = {}
    expected = []
    for server_round in range(1, spec.rounds + 1):
        picked = sample_clients(spec.seed, server_round, spec.clients.total, spec.clients.sampled)
        visits |= {c: visits.get(c, 0) + 1 for c in picked}
        expected.append(float(max(visits[c] for c in picked)))
    for result in (engine, services):
        train = [h["metrics"]["train"] for h in result["history"][1:]]
        assert [t["visits"] for t in train] == expected
        assert all(t["kept_right"] == 1.0 for t in train), "ints, bools, floats and tensors as they were left"
    assert digests(engine) == digests(services)


def test_kept_optimizer_state_changes_the_run(tmp_path: Path) -> None:
    """The state is used, not only kept: momentum carried over lands elsewhere than momentum afresh."""
    changes: dict[str, Any] = {"train__momentum": 0.9, "train__fuse": False, "clients__per_round": 3,
                               "rounds": 3}
    kept = run_job(small_job(train__keep_optimizer_state=True, **changes), Settings(state_dir=tmp_path / "k"))
    afresh = run_job(small_job(**changes), Settings(state_dir=tmp_path / "a"))
    assert digests(kept)[:2] == digests(afresh)[:2], "round 1 trains every client afresh either way"
    assert digests(kept)[2:] != digests(afresh)[2:]


def test_a_checkpoint_over_the_jobs_disk_quota_fails_the_job_saying_so(tmp_path: Path) -> None:
    spec = small_job(rounds=4)
    weights = TaskRuntime.for_job(spec).build_model().state_dict()
    model = sum(t.numel() * t.element_size() for t in weights.values())
    # Room for the first checkpoints, not for all of them: the job fails at a later one.
    result = run_job(spec, Settings(state_dir=tmp_path, checkpoint_every=1, job_disk_bytes=3 * model))
    assert result["status"] == "failed"
    assert "checkpoint" in result["reason"] and "FEDMQ_JOB_DISK_BYTES" in result["reason"], result["reason"]
    assert 0 < len(result["history"]) < spec.rounds + 1, "it ran until the quota stopped it"
    fits = run_job(spec, Settings(state_dir=tmp_path / "roomy", checkpoint_every=1, job_disk_bytes=1 << 30))
    assert fits["status"] == "completed"


def test_the_clients_a_job_samples_load_once_before_its_first_round_when_they_fit(tmp_path: Path) -> None:
    spec = small_job(rounds=4, clients__total=10, clients__per_round=3)
    sampled = {c for r in range(1, spec.rounds + 1) for c in sample_clients(spec.seed, r, 10, 3)}
    fits, preloaded, loads = _loaded_before_round_1(spec, Settings(state_dir=tmp_path / "fits"))
    assert preloaded == sampled and set(loads.values()) == {1}, "each once, before round 1"
    # A cache of one round's clients: each loads when its task comes.
    lazy, none, _ = _loaded_before_round_1(spec, Settings(state_dir=tmp_path / "lazy", data_cache_clients=3))
    assert none == set()
    assert digests(fits) == digests(lazy)


def _loaded_before_round_1(
    spec: JobSpec, settings: Settings
) -> tuple[dict[str, Any], set[int], dict[tuple[str, int], int]]:
    """The job's result, the clients whose data was loaded when round 1 started, and every load."""
    engines: list[Engine] = []
    before: list[set[int]] = []

    def first_round(event: JobEvent) -> None:
        if event.kind == "round_started" and event.round == 1:
            before.append({client for _, client in engines[0].work.data.loads})

    result = run_job(spec, settings, on_event=first_round, on_engine=engines.append)
    return result, before[0], engines[0].work.data.loads
