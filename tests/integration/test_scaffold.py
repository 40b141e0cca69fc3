"""SCAFFOLD end to end on the in-memory bus: controls travel both ways, a restart resumes exactly,
anything but plain SGD is refused, and digits trains on label-skewed clients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fedmq
from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import load_job
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from fedmq.services.scheduler.sampling import sample_clients
from fedmq.tasks.digits import Digits
from tests.conftest import REPO, assert_bit_identical, small_job
from tests.integration.test_pause import InterruptWhen

Tensors = dict[str, torch.Tensor]
SEEN: list[tuple[int, int, Tensors, Tensors]] = []  # (round, client, client state sent, extras back)


class OwnLoop(Digits):
    """Digits trained by its own SGD loop with SCAFFOLD's controls, as the contract shows; records them."""

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        x, y = data
        controls = fedmq.Controls.for_round(model, ctx)
        optimizer = torch.optim.SGD(model.parameters(), lr=ctx.train.lr)
        for _ in range(ctx.train.epochs):
            for batch in torch.randperm(len(y), generator=ctx.generator).split(ctx.train.batch_size):
                optimizer.zero_grad()
                self.loss(model, (x[batch], y[batch]))[0].backward()
                if controls:
                    controls.correct()
                optimizer.step()
        extras = controls.extras() if controls else {}
        SEEN.append((ctx.round, ctx.client, {k: v.clone() for k, v in ctx.client_state.items()}, extras))
        return fedmq.TrainResult(len(y), {}, extras)


def scaffold_job(**changes: Any) -> Any:
    return small_job(**{"strategy": {"name": "scaffold"}, "clients__per_round": 3, "rounds": 4, **changes})


def strategy_metrics(result: dict[str, Any]) -> list[dict[str, float]]:
    return [h["metrics"]["strategy"] for h in result["history"] if h["round"] > 0]


def test_each_client_gets_the_server_control_and_its_own_and_its_deltas_come_back_into_them(
    settings: Settings,
) -> None:
    SEEN.clear()
    spec = scaffold_job(task__name="tests.integration.test_scaffold:OwnLoop")
    result = run_job(spec, settings, idle_timeout=60)
    assert result["status"] == "completed", result.get("reason")
    samples = [sample_clients(spec.seed, r, 5, 3) for r in range(1, spec.rounds + 1)]
    seen = {(r, c): (sent, back) for r, c, sent, back in SEEN}
    assert sorted(seen) == sorted((r, c) for r, clients in enumerate(samples, 1) for c in clients)
    params = {f"dc.{name}" for name, _ in Digits(**spec.task.options).build_model().named_parameters()}
    server = {k[3:]: torch.zeros_like(v) for k, v in seen[1, samples[0][0]][1].items()}
    own: dict[int, Tensors] = {}
    for r, clients in enumerate(samples, 1):
        for c in clients:
            sent, back = seen[r, c]
            assert set(back) == params
            assert {k for k in sent if k.startswith("c_i.")} == {f"c_i.{k}" for k in own.get(c, {})}
            for name, c_i in own.get(c, {}).items():
                assert torch.equal(sent[f"c_i.{name}"], c_i), f"round {r} client {c}: c_i + dc, as stored"
            for name, control in server.items():
                expected = sent.get(f"c.{name}", torch.zeros_like(control))
                torch.testing.assert_close(expected, control, rtol=1e-6, atol=1e-7)
        for c in clients:
            _, back = seen[r, c]
            own[c] = {k[3:]: own.get(c, {}).get(k[3:], torch.zeros_like(v)) + v for k, v in back.items()}
            for name in server:
                server[name] = server[name] + back[f"dc.{name}"] / 5  # c + (|S|/N)·mean(dc)
    assert result["final"]["server.accuracy"] > result["initial"]["server.accuracy"]


def test_a_scaffold_job_stopped_and_resumed_ends_as_an_undisturbed_run(
    settings: Settings, tmp_path: Any
) -> None:
    spec = scaffold_job(rounds=5, round_timeout_s=600)
    undisturbed = run_job(spec, Settings(state_dir=tmp_path / "undisturbed"), idle_timeout=60)
    with pytest.raises(KeyboardInterrupt):
        run_job(spec, settings, job_id="scaffold", idle_timeout=60,
                interrupt=InterruptWhen(lambda job: job["round"] >= 3))
    resumed = run_job(spec, settings, job_id="scaffold", resume=True, idle_timeout=60)
    assert resumed["status"] == "completed"
    assert strategy_metrics(resumed) == strategy_metrics(undisturbed)
    assert_bit_identical(load_state(resumed["model_path"])[0], load_state(undisturbed["model_path"])[0])
    shared = settings.state_dir / "aggregator" / "scaffold" / "clients" / "shared"
    assert [p.name for p in shared.iterdir()] == ["r5.safetensors"], "one shared version after prune"


def test_scaffold_with_adam_fails_the_job_saying_it_needs_plain_sgd(settings: Settings) -> None:
    result = run_job(scaffold_job(rounds=1, train__optimizer="adam"), settings, idle_timeout=60)
    assert result["status"] == "failed"
    assert "SCAFFOLD (option II) needs plain SGD steps" in result["reason"]
    assert "set train.optimizer: sgd" in result["reason"]


@pytest.mark.slow
def test_scaffold_trains_digits_on_strongly_label_skewed_clients_better_than_fedavg(tmp_path: Path) -> None:
    """examples/digits.yaml cut to 10 rounds, Dirichlet 0.1 labels: the client drift SCAFFOLD corrects."""
    digits = load_job(REPO / "examples" / "digits.yaml")
    task = {**digits.task.model_dump(mode="json"), "options": {
        **digits.task.options, "partition": {"kind": "dirichlet", "alpha": 0.1}}}
    spec = digits.with_changes(rounds=10, task=task)
    fedavg = fedmq.run(spec, state_dir=tmp_path / "fedavg")
    scaffold = fedmq.run(spec.with_changes(strategy={"name": "scaffold"}), state_dir=tmp_path / "scaffold")
    accuracy, baseline = (r.metric("server.accuracy")[-1][1] for r in (scaffold, fedavg))
    assert accuracy > 0.85, "a sane accuracy on digits"
    assert accuracy > baseline, (accuracy, baseline)
