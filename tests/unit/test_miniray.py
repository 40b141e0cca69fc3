"""Seed 002's trainer API (fedmq.compat.miniray) on the in-process engine: the hooks it promises,
and the errors a seed-002 user hits first, each named in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmq.compat.miniray import DataParallelTrainer
from tests.conftest import REPO


class Worker:
    """Two tensors; an epoch sets both to the worker's id (`short`: then gives one of them back)."""

    def __init__(self, worker_id: int, short: bool = False) -> None:
        self.id, self.short, self.trained = worker_id, short, False
        self.a, self.b = torch.zeros(3), torch.zeros(2)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.a, self.b = torch.full((3,), float(self.id)), torch.full((2,), float(self.id))
        self.trained = True
        return {"loss": float(self.id)}

    def get_weights(self) -> list[torch.Tensor]:
        return [self.a] if self.short and self.trained else [self.a, self.b]

    def set_weights(self, weights: list[torch.Tensor]) -> None:
        self.a, self.b = weights[0].clone(), weights[1].clone()


class Trainer(DataParallelTrainer):
    def create_worker(self, worker_id: int, **kwargs: Any) -> Worker:
        return Worker(worker_id, short=bool(kwargs.get("short")))

    def evaluate(self, worker: Worker) -> dict[str, float]:
        return {"a": float(worker.a[0])}


class Weighting(Trainer):
    def on_train_start(self, **kwargs: Any) -> None:
        self.set_worker_weight(1, 3.0)


@pytest.mark.parametrize(("trainer", "synced"), [(Trainer, 0.5), (Weighting, 0.75)],
                         ids=["equal", "weight-set-in-on_train_start"])
def test_a_worker_weight_set_in_on_train_start_takes_effect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainer: type[Trainer], synced: float
) -> None:
    monkeypatch.chdir(tmp_path)  # fedmq.run keeps its state in ./.fedmq
    out = trainer(num_workers=2, sync_strategy="weighted").train(epochs=1)
    assert set(out) == {"history", "workers", "num_epochs"} and out["num_epochs"] == 1
    assert out["history"][-1]["a"] == synced  # workers 0 and 1 weighted 1 and 1 (or 3): the mean of their ids


def test_an_argument_that_cannot_travel_is_refused_at_construction_in_one_line() -> None:
    with pytest.raises(TypeError, match=r"Trainer\(\): argument 'model' is a object, which cannot travel"):
        Trainer(num_workers=2, model=object())
    with pytest.raises(TypeError, match=r"train\(\): argument 'data' is a Tensor"):
        Trainer(num_workers=2).train(epochs=1, data=torch.zeros(2))


def test_weights_that_do_not_fit_the_first_sync_name_the_method_and_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="get_weights returned 1 tensors, the first sync had 2"):
        Trainer(num_workers=2).train(epochs=1, short=True)


SCRIPT = '''
import torch
from fedmq.compat.miniray import DataParallelTrainer

class Worker:
    def __init__(self, worker_id): self.w = torch.zeros(2)
    def train_epoch(self, epoch): return {"loss": 1.0}
    def get_weights(self): return [self.w]
    def set_weights(self, weights): self.w = weights[0].clone()

class Unguarded(DataParallelTrainer):
    def create_worker(self, worker_id, **kwargs): return Worker(worker_id)

print(Unguarded(num_workers=2).train(epochs=2)["history"][-1]["epoch"])  # no `if __name__ == "__main__":`
'''


def test_a_script_without_a_main_guard_trains_once_in_its_own_process(tmp_path: Path) -> None:
    """Its trainer class comes from the running script, not from importing it again (which ran
    the training again, inside the first, and hung)."""
    (tmp_path / "unguarded.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "unguarded.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1"], out.stdout


class NormWorker:
    """A BatchNorm MLP trained by SGD with momentum on its own shuffling generator: everything a
    living worker keeps between syncs besides its weights (buffers, momentum, a generator)."""

    def __init__(self, worker_id: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                         torch.nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.shuffle = torch.Generator().manual_seed(100 + worker_id)
        g = torch.Generator().manual_seed(worker_id)
        self.x, self.y = torch.randn(24, 4, generator=g), torch.randn(24, generator=g)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        for idx in torch.randperm(24, generator=self.shuffle).split(8):
            self.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(self.x[idx]).squeeze(1), self.y[idx])
            loss.backward()
            self.opt.step()
        return {"loss": loss.item()}

    def get_weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def set_weights(self, weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, w in zip(self.model.parameters(), weights, strict=True):
                p.copy_(w)


class NormTrainer(DataParallelTrainer):
    def create_worker(self, worker_id: int, **kwargs: Any) -> NormWorker:
        return NormWorker(worker_id)


def test_a_worker_keeps_its_buffers_momentum_and_generator_between_syncs_as_a_living_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    trainer = NormTrainer(num_workers=2)
    trained = trainer.train(epochs=4)["workers"]
    assert trainer.result is not None
    synced = list(trainer.result.weights().values())
    living = [NormWorker(0), NormWorker(1)]  # seed 002's actors: built once, alive through train()
    weights = living[0].get_weights()
    for _ in range(4):
        for worker in living:
            worker.set_weights(weights)
            worker.train_epoch(0)
        weights = [torch.stack(ws).mean(0) for ws in zip(*(w.get_weights() for w in living), strict=True)]
    gap = max(float((a - b).abs().max()) for a, b in zip(synced, weights, strict=True))
    assert gap < 1e-5, f"fedmq's workers are {gap:.2e} from living ones"
    # train() gives the workers back as training left them: the synced weights, each worker's own
    # BatchNorm statistics, momentum and generator (what evaluating through worker 0 needs).
    for mine, alive in zip(trained, living, strict=True):
        alive.set_weights(weights)
        ours, theirs = mine.model.state_dict(), alive.model.state_dict()
        assert max(float((ours[k].double() - theirs[k].double()).abs().max()) for k in ours) < 1e-5
        assert torch.equal(mine.shuffle.get_state(), alive.shuffle.get_state())
        bufs = [mine.opt.state[p]["momentum_buffer"] for p in mine.model.parameters()]
        want = [alive.opt.state[p]["momentum_buffer"] for p in alive.model.parameters()]
        assert max(float((a - b).abs().max()) for a, b in zip(bufs, want, strict=True)) < 1e-5


class Watching(Trainer):
    def on_train_start(self, **kwargs: Any) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_epoch_end(self, epoch: int, result: dict[str, Any], **kwargs: Any) -> None:
        self.seen.append(result)


def test_each_sync_reports_seed_002s_fields_with_every_workers_own_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # fedmq.run keeps its state in ./.fedmq
    trainer = Watching(num_workers=3, sync_interval=2)
    out = trainer.train(epochs=4)
    seen = trainer.seen
    assert len(seen) == 2 and all(a is b for a, b in zip(out["history"], seen, strict=True))
    assert [r["epoch"] for r in seen] == [1, 3] and [r["sync_version"] for r in seen] == [1, 2]
    assert all(r["synced"] is True and r["time"] > 0 for r in seen)
    # each worker's loss is its id; the averaged one is their mean
    assert [r["worker_results"] for r in seen] == [[{"loss": 0.0}, {"loss": 1.0}, {"loss": 2.0}]] * 2
    assert [r["loss"] for r in seen] == [1.0, 1.0]


@pytest.mark.parametrize("services", [False, True], ids=["engine", "services"])
def test_a_rounds_record_keeps_each_clients_training_metrics_on_either_path(
    tmp_path: Path, services: bool
) -> None:
    import fedmq

    job = Trainer(num_workers=3).job(2)
    result = fedmq.run(job, state_dir=tmp_path, services=services)
    assert result.ok, result.reason
    assert [dict(r.client_metrics) for r in result.history if r.round > 0] == [
        {0: {"loss": 0.0}, 1: {"loss": 1.0}, 2: {"loss": 2.0}}] * 2
