"""Seed 002's Mini-Ray Train worker and trainer, run by fedmq: 20 lines of user code on digits.

    python -m examples.seed002_worker                  # in this process
    FEDMQ_BROKER_URL=amqp://... python -m examples.seed002_worker --broker   # on a cluster

The worker is seed 002's shape (train_epoch, get_weights, set_weights, load_data_shard); the
shard comes from fedmq's digits Task so that the example needs no download.
"""

import sys

import torch
from torch import nn

import fedmq
from fedmq.compat.miniray import DataParallelTrainer
from fedmq.tasks.digits import Digits


class DigitsWorker:
    def __init__(self, worker_id: int, lr: float = 0.05) -> None:
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.opt, self.loss = torch.optim.SGD(self.model.parameters(), lr=lr), nn.CrossEntropyLoss()

    def load_data_shard(self, shard_id: int, num_shards: int, batch_size: int = 32) -> None:
        ctx = fedmq.DataContext(client=shard_id, num_clients=num_shards, seed=0)
        self.x, self.y = Digits().load_data(ctx).train
        self.batch_size = batch_size

    def train_epoch(self, epoch: int) -> dict[str, float]:
        for idx in torch.randperm(len(self.y)).split(self.batch_size):
            self.opt.zero_grad()
            (loss := self.loss(self.model(self.x[idx]), self.y[idx])).backward()
            self.opt.step()
        return {"loss": loss.item()}

    def get_weights(self) -> list[torch.Tensor]:
        return [p.detach().cpu().clone() for p in self.model.parameters()]

    def set_weights(self, weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, value in zip(self.model.parameters(), weights, strict=True):
                param.copy_(value)


class DigitsTrainer(DataParallelTrainer):
    def create_worker(self, worker_id: int, **kwargs: object) -> DigitsWorker:
        return DigitsWorker(worker_id)

    def evaluate(self, worker: DigitsWorker) -> dict[str, float]:
        x, y = Digits().load_server_data(fedmq.DataContext(client=-1, num_clients=1, seed=0))
        return {"accuracy": (worker.model(x).argmax(1) == y).float().mean().item()}

    def on_epoch_end(self, epoch: int, result: dict, **kwargs: object) -> None:
        print(f"epoch {epoch}: loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f}")


def main(broker: str | None = None) -> fedmq.Result:
    with DigitsTrainer(num_workers=4, sync_interval=2, sync_strategy="weighted", broker=broker) as trainer:
        trainer.set_worker_weight(0, 2.0)
        trainer.train(epochs=20, batch_size=32)
        print(trainer.get_sync_stats())
        assert trainer.result is not None
        return trainer.result


if __name__ == "__main__":
    import os

    main(os.environ.get("FEDMQ_BROKER_URL") if "--broker" in sys.argv else None)
