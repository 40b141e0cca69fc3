"""A seed-002 worker of the hard kind (BatchNorm, SGD momentum, its own generator) through
fedmq.compat.miniray, evaluated through the trained worker 0 that `train()` returns, against
seed 002's semantics run in one process: the same workers alive through training, averaged
every sync."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fedmq
from fedmq.compat.miniray import DataParallelTrainer
from fedmq.tasks.digits import Digits
from tests.support.seed002 import living

WORKERS, SYNC, EPOCHS = 4, 2, 12


class CnnWorker:
    def __init__(self, worker_id: int) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.gen = torch.Generator().manual_seed(worker_id)

    def load_data_shard(self, shard_id: int, num_shards: int, **kwargs: Any) -> None:
        ctx = fedmq.DataContext(client=shard_id, num_clients=num_shards, seed=0)
        self.x, self.y = Digits(partition={"kind": "iid"}).load_data(ctx).train

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        for idx in torch.randperm(len(self.y), generator=self.gen).split(32):
            self.opt.zero_grad()
            loss = nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx])
            loss.backward()
            self.opt.step()
        return {"loss": loss.item()}

    def get_weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def set_weights(self, weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, w in zip(self.model.parameters(), weights, strict=True):
                p.copy_(w)


class CnnTrainer(DataParallelTrainer):
    def create_worker(self, worker_id: int, **kwargs: Any) -> CnnWorker:
        return CnnWorker(worker_id)


def accuracy(worker: CnnWorker) -> float:
    ctx = fedmq.DataContext(client=-1, num_clients=1, seed=0)
    x, y = Digits(partition={"kind": "iid"}).load_server_data(ctx)
    worker.model.eval()
    with torch.no_grad():
        return float((worker.model(x).argmax(1) == y).float().mean())


@pytest.mark.slow  # 8 s of training: the full tier, not `make test-fast`
def test_a_batchnorm_cnn_worker_evaluated_through_trained_worker_0_matches_living_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = CnnTrainer(num_workers=WORKERS, sync_interval=SYNC).train(epochs=EPOCHS)
    ours = accuracy(out["workers"][0])
    reference = accuracy(living(CnnWorker, WORKERS, SYNC, EPOCHS))
    assert ours >= 0.95 and abs(ours - reference) <= 0.005, (ours, reference)
