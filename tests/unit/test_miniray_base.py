"""Seed 002's BaseTrainer and actor calls (fedmq.compat.actors, through fedmq.compat.miniray)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmq.compat import miniray
from tests.unit.test_miniray import Worker


class Counting:
    """A worker that remembers: each call adds to its own running total."""

    def __init__(self, worker_id: int, step: float = 1.0) -> None:
        self.id, self.step, self.total = worker_id, step, 0.0

    def custom_method(self, epoch: int) -> float:
        self.total += self.step * (self.id + 1)
        return self.total


# As `@miniray.remote` on the class does (mypy reads a class decorator's class as the class itself)
Counter: Any = miniray.remote(Counting)


class CustomTrainer(miniray.BaseTrainer):
    def __init__(self, num_workers: int = 3) -> None:
        super().__init__(num_workers=num_workers)
        self.calls: list[str] = []

    def create_worker(self, worker_id: int, **kwargs: Any) -> Any:
        return Counter.remote(worker_id, **kwargs)

    def train_epoch(self, epoch: int, **kwargs: Any) -> dict[str, Any]:
        results = miniray.get([w.custom_method.remote(epoch) for w in self.workers])
        return {"custom_metric": sum(results) / len(results)}

    def on_train_start(self, **kwargs: Any) -> None:
        self.calls.append("start")

    def on_epoch_start(self, epoch: int, **kwargs: Any) -> None:
        self.calls.append(f"epoch {epoch}")

    def on_epoch_end(self, epoch: int, result: dict[str, Any], **kwargs: Any) -> None:
        super().on_epoch_end(epoch, result, **kwargs)
        self.calls.append(f"end {epoch}")


def test_a_base_trainer_runs_its_own_loop_over_workers_that_live_through_train() -> None:
    with CustomTrainer(num_workers=3) as trainer:
        out = trainer.train(epochs=4, step=2.0)
    assert set(out) == {"history", "workers", "num_epochs"} and out["num_epochs"] == 4
    # worker i adds 2·(i + 1) an epoch to what it kept: the mean over workers is 4·(epoch + 1)
    assert [entry["custom_metric"] for entry in out["history"]] == [4.0, 8.0, 12.0, 16.0]
    assert [entry["epoch"] for entry in out["history"]] == [0, 1, 2, 3]
    assert all(entry["time"] >= 0 for entry in out["history"])
    assert trainer.calls == ["start"] + [f"{kind} {e}" for e in range(4) for kind in ("epoch", "end")]
    assert [w.total for w in out["workers"]] == [8.0, 16.0, 24.0]  # the workers themselves
    assert isinstance(miniray.unwrap(out["workers"][0]), Counting)


def test_get_opens_refs_lists_of_them_and_leaves_anything_else() -> None:
    ref = Counter.remote(0).custom_method.remote(0)
    assert isinstance(ref, miniray.Ref)
    assert miniray.get(ref) == 1.0
    assert miniray.get((ref, ref)) == [1.0, 1.0]
    assert miniray.get(5) == 5


def test_a_base_trainer_without_its_loop_says_what_to_define() -> None:
    class Bare(miniray.BaseTrainer):
        def create_worker(self, worker_id: int, **kwargs: Any) -> Any:
            return Counter.remote(worker_id)

    with pytest.raises(NotImplementedError, match=r"define train_epoch\(epoch, \*\*kwargs\)"):
        Bare(num_workers=1).train(epochs=1)


RemoteWorker: Any = miniray.remote(type("RemoteWorker", (Worker,), {}))


class ActorTrainer(miniray.DataParallelTrainer):
    """Seed 002's way: create_worker returns `Worker.remote(...)`."""

    def create_worker(self, worker_id: int, **kwargs: Any) -> Any:
        return RemoteWorker.remote(worker_id)


def test_a_data_parallel_trainer_takes_workers_built_with_remote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # fedmq.run keeps its state in ./.fedmq
    trainer = ActorTrainer(num_workers=2)
    assert isinstance(trainer, miniray.BaseTrainer)
    out = trainer.train(epochs=1)
    assert out["history"][-1]["loss"] == 0.5  # the workers' ids, averaged
    workers = out["workers"]
    assert len(workers) == 2 and isinstance(workers[0], miniray.Actor)
    assert torch.equal(miniray.get(workers[1].get_weights.remote())[0], torch.full((3,), 0.5))


class Holder:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 1)  # callable, yet an attribute, not a method

    def weight(self) -> torch.Tensor:
        return self.model.weight


def test_an_actor_gives_its_workers_attributes_as_they_are_and_its_methods_with_remote() -> None:
    actor = miniray.Actor(Holder())
    assert isinstance(actor.model, torch.nn.Linear)
    assert list(actor.model.parameters())  # not wrapped: a model's own methods work
    assert miniray.get(actor.weight.remote()) is actor.model.weight
    actor.extra = 3
    assert miniray.unwrap(actor).extra == 3
    with pytest.raises(TypeError, match="not pickled"):
        copy.copy(actor)


class OwnEpochs(miniray.DataParallelTrainer):
    def create_worker(self, worker_id: int, **kwargs: Any) -> Any:
        return Worker(worker_id)

    def train_epoch(self, epoch: int, **kwargs: Any) -> dict[str, Any]:
        return {"never": 1.0}


def test_a_data_parallel_trainer_with_its_own_train_epoch_is_told_to_use_base_trainer() -> None:
    with pytest.raises(TypeError, match="subclass miniray.BaseTrainer for a training loop of your own"):
        OwnEpochs(num_workers=1).train(epochs=1)
