"""Compressed updates through the services: wire bytes, accuracy, restarts, strategies, hostile input."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmq.common.bus import topology
from fedmq.common.bus.memory import MemoryBroker, MemoryBus
from fedmq.common.checkpoint import load_state
from fedmq.common.codec import updates
from fedmq.common.codec.compress import CompressionSpec, Residual
from fedmq.common.jobspec import load_job
from fedmq.common.messages import ClientUpdate, JobEvent, to_wire
from fedmq.common.settings import Settings
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.cli.embedded import run_job
from fedmq.services.learner import work
from fedmq.services.learner.work import compressed
from fedmq.services.scheduler.sampling import sample_clients
from tests.conftest import REPO, EmbeddedRuns, assert_bit_identical, small_job
from tests.integration import train_plugins
from tests.integration.test_pause import InterruptWhen
from tests.integration.test_user_strategy import COUNTING, strategy_metrics
from tests.rabbit import fresh_vhost

TOPK = {"codec": "topk", "fraction": 0.1}
TOPK_INT8 = {**TOPK, "residual": "int8"}


def update_bytes(result: dict[str, Any]) -> list[float]:
    return [h["metrics"]["transport"]["update_bytes"] for h in result["history"][1:]]


def state_bytes(result: dict[str, Any]) -> list[float]:
    return [h["metrics"]["transport"]["state_bytes"] for h in result["history"][1:]]


@pytest.mark.slow
def test_int8_cuts_the_bytes_per_round_at_least_3_5_times_and_keeps_accuracy_within_a_point(
    tmp_path: Path,
) -> None:
    spec = load_job(REPO / "examples" / "digits.yaml").with_changes(rounds=10)
    plain = run_job(spec, Settings(state_dir=tmp_path / "none"), idle_timeout=120)
    int8 = run_job(spec.with_changes(compression={"codec": "int8"}), Settings(state_dir=tmp_path / "int8"),
                   idle_timeout=120)
    assert plain["status"] == int8["status"] == "completed"
    # The bodies of the updates as the aggregator received them, every round.
    ratios = [a / b for a, b in zip(update_bytes(plain), update_bytes(int8), strict=True)]
    assert min(ratios) >= 3.5, ratios
    drop = plain["final"]["server.accuracy"] - int8["final"]["server.accuracy"]
    assert abs(drop) <= 0.01, (plain["final"], int8["final"])


def test_every_round_reports_its_update_bytes_and_compression_lowers_them(
    settings: Settings, tmp_path: Path
) -> None:
    plain = run_job(small_job(rounds=2), settings, idle_timeout=60)
    half = run_job(small_job(rounds=2, compression="float16"), Settings(state_dir=tmp_path / "f16"),
                   idle_timeout=60)
    assert "transport" not in plain["history"][0]["metrics"], "round 0 received no updates"
    assert all(b > 0 for b in update_bytes(plain))
    assert all(h < p for h, p in zip(update_bytes(half), update_bytes(plain), strict=True))
    assert half["final"]["transport.update_bytes"] == update_bytes(half)[-1]


@pytest.mark.slow  # 3 s each, four runs: kept out of the 2-minute tier
@pytest.mark.parametrize("residual", ["float32", "bfloat16", "int8"])
def test_topk_with_error_feedback_runs_the_same_twice_and_stopped_and_resumed_ends_as_an_undisturbed_run(
    settings: Settings, tmp_path: Path, residual: str
) -> None:
    spec = small_job(rounds=5, compression={**TOPK, "residual": residual}, clients__per_round=3,
                     round_timeout_s=600)
    undisturbed = run_job(spec, Settings(state_dir=tmp_path / "undisturbed"), idle_timeout=60)
    again = run_job(spec, Settings(state_dir=tmp_path / "again"), idle_timeout=60)
    assert_bit_identical(load_state(again["model_path"])[0], load_state(undisturbed["model_path"])[0])
    with pytest.raises(KeyboardInterrupt):
        run_job(spec, settings, job_id="topk", idle_timeout=60,
                interrupt=InterruptWhen(lambda job: job["round"] >= 3))
    resumed = run_job(spec, settings, job_id="topk", resume=True, idle_timeout=60)
    assert resumed["status"] == undisturbed["status"] == "completed"
    assert_bit_identical(load_state(resumed["model_path"])[0], load_state(undisturbed["model_path"])[0])
    residuals = settings.state_dir / "aggregator" / "topk" / "residuals"
    kept = sorted(p.relative_to(residuals).as_posix() for p in residuals.rglob("*.safetensors"))
    assert len(kept) == len({p.split("/")[0] for p in kept}) > 0, f"one per client after prune: {kept}"
    stored = load_state(next(residuals.rglob("*.safetensors")))[0]
    assert any(bool(t.abs().sum() > 0) for t in stored.values()), "topk leaves a residual behind"
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[residual]
    assert {t.dtype for k, t in stored.items() if k.startswith(updates.RESIDUAL)} == {want}
    assert not (residuals.parent / "clients").exists(), "fedavg keeps no client state"


def test_topk_without_error_feedback_carries_no_residual_either_way_and_trains_differently(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    received: list[int] = []

    def counting(stored: dict[str, torch.Tensor]) -> tuple[dict[str, Any], Residual]:
        others, residual = updates.split_residual(stored)
        received.append(len(residual.values))
        return others, residual

    monkeypatch.setattr(work, "split_residual", counting)
    spec = small_job(rounds=2, compression=TOPK, train__fuse=False)  # a fused task fetches no state at all
    fed_back = run_job(spec, settings, idle_timeout=60)
    assert sum(received) > 0
    received.clear()
    plain = run_job(spec.with_changes(compression={"error_feedback": False}),
                    Settings(state_dir=tmp_path / "p"), idle_timeout=60)
    assert received == [0] * 2 * spec.clients.sampled, "no residual comes back to a learner"
    assert fed_back["status"] == plain["status"] == "completed"
    assert state_bytes(plain) == [0.0, 0.0] and all(b > 0 for b in state_bytes(fed_back))
    assert all(p < f for p, f in zip(update_bytes(plain), update_bytes(fed_back), strict=True))
    assert not list((tmp_path / "p").rglob("residuals")), "nothing kept for the way back"
    a, b = load_state(fed_back["model_path"])[0], load_state(plain["model_path"])[0]
    assert any(not torch.equal(a[k], b[k]) for k in a), "round 2 without the residual differs"


def test_topk_001_with_an_int8_residual_sends_fewer_update_bytes_than_none_and_float32_residuals_more(
    settings: Settings, tmp_path: Path
) -> None:
    spec = small_job(rounds=2)
    runs = {
        name: run_job(spec.with_changes(compression=compression), Settings(state_dir=tmp_path / name),
                      idle_timeout=60)
        for name, compression in [("none", {"codec": "none"}),
                                  ("float32", {"codec": "topk", "fraction": 0.01}),
                                  ("int8", {"codec": "topk", "fraction": 0.01, "residual": "int8"})]
    }
    assert {r["status"] for r in runs.values()} == {"completed"}
    none, f32, int8 = (update_bytes(runs[n]) for n in ("none", "float32", "int8"))
    assert all(i < n < f for i, n, f in zip(int8, none, f32, strict=True)), (int8, none, f32)
    model = TaskRuntime.for_job(spec).build_model().state_dict()
    floats = [t for t in model.values() if t.is_floating_point()]
    per_client = sum(t.numel() for t in floats) + 4 * len(floats)  # q, and a float32 scale per tensor
    assert state_bytes(runs["int8"]) == [float(spec.clients.sampled * per_client)] * 2
    assert state_bytes(runs["none"]) == [0.0, 0.0]


def test_the_topk_residual_comes_back_to_the_learner_and_changes_what_it_sends(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = small_job(rounds=2, compression=TOPK)
    fed_back = run_job(spec, settings, idle_timeout=60)
    received: list[int] = []

    def forgetting(stored: dict[str, torch.Tensor]) -> tuple[dict[str, Any], Residual]:
        others, residual = updates.split_residual(stored)
        received.append(len(residual.values))
        return others, Residual({}, {})  # as if the residual never came back

    monkeypatch.setattr(work, "split_residual", forgetting)
    forgot = run_job(spec, Settings(state_dir=tmp_path / "forgot"), idle_timeout=60)
    assert fed_back["status"] == forgot["status"] == "completed"
    n = spec.clients.total
    model = TaskRuntime.for_job(spec).build_model().state_dict()
    floats = [t for t in model.values() if t.is_floating_point()]
    assert received == [0] * n + [len(floats)] * n, "round 1 has no residual; round 2 gets each client's"
    a, b = load_state(fed_back["model_path"])[0], load_state(forgot["model_path"])[0]
    assert any(not torch.equal(a[k], b[k]) for k in a), "round 2 trained on with the residual added"


def test_a_users_strategy_with_client_state_and_extras_works_unchanged_under_topk(settings: Settings) -> None:
    spec = small_job(**COUNTING, compression=TOPK)
    result = run_job(spec, settings, idle_timeout=60)
    assert result["status"] == "completed", result.get("reason")
    metrics = strategy_metrics(result)
    assert [m["mismatched"] for m in metrics] == [0.0] * spec.rounds, "its state and the residual kept apart"
    assert result["final"]["server.accuracy"] > result["initial"]["server.accuracy"]


class WatchedMemoryBus(MemoryBus):
    """The aggregator's in-memory bus: besides the cluster's hook, tells the test of each dead letter."""

    def __init__(self, broker: MemoryBroker, seen: Callable[[str], None]) -> None:
        self._seen = seen
        self._hook: Callable[[str], None] | None = None
        super().__init__(broker)

    @property
    def on_dead_letter(self) -> Callable[[str], None]:
        return self._refused

    @on_dead_letter.setter
    def on_dead_letter(self, hook: Callable[[str], None] | None) -> None:
        self._hook = hook

    def _refused(self, reason: str) -> None:
        if self._hook is not None:
            self._hook(reason)
        self._seen(reason)


def hostile_updates(job_id: str, digest: str, spec: Any, client: int) -> list[bytes]:
    """int8 updates for a real client of round 2: a NaN scale, an index of topk, a missing part."""
    base = TaskRuntime.for_job(spec).build_model().state_dict()
    plain = ClientUpdate(job_id=job_id, task_id="evil", round=2, client=client, base_digest=digest,
                         num_examples=10, weights={k: v + 0.01 if v.is_floating_point() else v
                                                   for k, v in base.items()})
    sound = compressed(plain, base, CompressionSpec(codec="int8"), None)
    nan_scale = {**sound.delta, "0.scale": torch.tensor(float("nan"))}
    missing = {k: v for k, v in sound.delta.items() if k != "1.q"}
    topk_meta = {**(sound.compression or {}), "codec": "topk"}
    return [to_wire(sound.model_copy(update=change)) for change in (
        {"delta": nan_scale}, {"delta": missing}, {"compression": topk_meta}, {"weights": dict(base)},
    )]


def test_hostile_compressed_updates_are_dead_lettered_counted_and_change_nothing(
    tmp_path: Path, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(rounds=3, compression="int8", task__name="tests.integration.train_plugins:Gated")
    undisturbed = embedded_runs.weights(spec)
    last_client = max(sample_clients(spec.seed, 2, spec.clients.total, spec.clients.sampled))
    broker = MemoryBroker()
    injector = broker.connect()
    refused: list[str] = []
    digests: dict[int, str] = {}
    real_update_may_go = train_plugins.gate(spec.seed, 2, last_client)
    injected = threading.Event()

    def aggregator_refused(reason: str) -> None:
        refused.append(reason)
        if len(refused) == 4:
            real_update_may_go.set()

    def on_event(event: JobEvent) -> None:
        if event.kind == "round_completed" and event.round is not None:
            digests[event.round] = event.data["model_digest"]
        if event.kind == "round_started" and event.round == 2 and not injected.is_set():
            injected.set()
            for body in hostile_updates(event.job_id, digests[1], spec, last_client):
                injector.publish(topology.AGGREGATOR, body)

    def connect(name: str) -> MemoryBus:
        return WatchedMemoryBus(broker, aggregator_refused) if name == "aggregator" else broker.connect()

    try:
        result = run_job(spec, Settings(state_dir=tmp_path), connect=connect, on_event=on_event,
                         idle_timeout=60)
    finally:
        train_plugins.reset()
    assert result["status"] == "completed"
    assert [h["failed"] for h in result["history"][1:]] == [0, 0, 0], "the gate opened in time"
    assert [r.split(":")[0] for r in refused] == ["bad_compression"] * 4
    assert result["dead_letters"] == {"bad_compression": 4}
    assert_bit_identical(load_state(result["model_path"])[0], undisturbed)


@pytest.mark.rabbitmq
@pytest.mark.parametrize("learners", [1, 3])
@pytest.mark.parametrize("compression", ["int8", TOPK, TOPK_INT8], ids=["int8", "topk", "topk-int8-residual"])
def test_a_compressed_job_gives_the_same_weights_on_rabbitmq_as_embedded(
    tmp_path: Path, learners: int, compression: Any, embedded_runs: EmbeddedRuns
) -> None:
    from fedmq.common.bus.rabbitmq import RabbitBus

    spec = small_job(rounds=3, clients__total=6, clients__per_round=4, compression=compression)
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, log_format="json", frame_bytes=64 * 1024)
        result = run_job(spec, settings, learners=learners, connect=lambda name: RabbitBus(settings, name),
                         idle_timeout=60)
    assert result["status"] == "completed", result.get("reason")
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))


def test_a_bfloat16_downlink_halves_the_model_learners_fetch_and_is_the_engines_run_bit_for_bit(
    tmp_path: Path,
) -> None:
    from fedmq.services.engine.run import run_job as run_engine

    spec = small_job(compression={"downlink": "bfloat16"}, rounds=3)
    exact = small_job(rounds=3)
    engine = run_engine(spec, Settings(state_dir=tmp_path / "engine", torch_threads=1))
    services = run_job(spec, Settings(state_dir=tmp_path / "services", torch_threads=1), idle_timeout=120)
    plain = run_engine(exact, Settings(state_dir=tmp_path / "exact", torch_threads=1))
    whole = run_job(exact, Settings(state_dir=tmp_path / "whole", torch_threads=1), idle_timeout=120)
    assert engine["status"] == services["status"] == plain["status"] == whole["status"] == "completed"
    assert_bit_identical(load_state(services["model_path"])[0], load_state(engine["model_path"])[0])
    assert [h["model_digest"] for h in services["history"]] == [h["model_digest"] for h in engine["history"]]
    rounded, full = load_state(engine["model_path"])[0], load_state(plain["model_path"])[0]
    assert any(not torch.equal(rounded[n], full[n]) for n in full), "learners trained from the rounded model"
    for record, exact_record in zip(engine["history"][1:], plain["history"][1:], strict=True):
        model_bytes = record["metrics"]["transport"]["model_bytes"]
        assert model_bytes * 2 == exact_record["metrics"]["transport"]["model_bytes"]
    assert abs(engine["final"]["server.accuracy"] - plain["final"]["server.accuracy"]) <= 0.02
    down = [h["sync"]["bytes_down"] / w["sync"]["bytes_down"]
            for h, w in zip(services["history"][1:], whole["history"][1:], strict=True)]
    assert all(0.45 < ratio < 0.6 for ratio in down), down  # half the tensor bytes, and the framing


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_the_downlinks_rounding_is_never_taken_for_a_clients_update(tmp_path: Path, codec: str) -> None:
    """Clients that change nothing (a step too small to move any float32) give back exactly the
    exact global model, whether they send weights whole or a delta: the run ends with the bits of
    the same run without the downlink, not with a model pulled toward its rounded copy."""
    from fedmq.services.engine.run import run_job as run_engine

    runs = {}
    for downlink in ("none", "bfloat16"):
        spec = small_job(rounds=3, train__lr=1e-30, compression={"codec": codec, "downlink": downlink})
        result = run_engine(spec, Settings(state_dir=tmp_path / downlink, torch_threads=1))
        assert result["status"] == "completed", result
        runs[downlink] = load_state(result["model_path"])[0]
    assert_bit_identical(runs["bfloat16"], runs["none"])
