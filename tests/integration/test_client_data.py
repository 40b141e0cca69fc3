"""Client-local, lazy data: a learner loads only the clients it serves, holds at most its cache
bound at once, and the aggregator never loads training data."""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch import nn

import fedmq
from fedmq.common.jobspec import parse_job
from fedmq.common.settings import Settings
from fedmq.common.task.loop import train_with_loss
from fedmq.services.cli.embedded import run_job

LOADED: dict[str, list[int]] = defaultdict(list)  # thread name -> clients whose data it loaded
TRAINED: dict[str, set[tuple[int, int]]] = defaultdict(set)  # thread name -> (round, client) it trained
LIVE: dict[str, int] = defaultdict(int)  # thread name -> client datasets alive now
MOST_LIVE: dict[str, int] = defaultdict(int)
_lock = threading.Lock()


class Shard(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A client's synthetic examples, made from its id; counted while alive."""

    def __init__(self, client: int, owner: str) -> None:
        g = torch.Generator().manual_seed(client)
        self.x = torch.randn(8, 4, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        with _lock:
            LIVE[owner] += 1
            MOST_LIVE[owner] = max(MOST_LIVE[owner], LIVE[owner])
        weakref.finalize(self, _gone, owner)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _gone(owner: str) -> None:
    with _lock:
        LIVE[owner] -= 1


class ManyClients(fedmq.Task):
    def build_model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def load_data(self, ctx: fedmq.DataContext) -> Shard:
        owner = threading.current_thread().name
        with _lock:
            LOADED[owner].append(ctx.client)
        return Shard(ctx.client, owner)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def train(self, model: nn.Module, data: Shard, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        with _lock:
            TRAINED[threading.current_thread().name].add((ctx.round, ctx.client))
        return train_with_loss(self, model, data, ctx)


def test_a_thousand_clients_on_two_learners_load_lazily_within_the_cache_bound(tmp_path: Any) -> None:
    spec = parse_job({
        "name": "many", "seed": 1, "task": {"name": f"{__name__}:ManyClients"},
        "clients": {"total": 1000, "per_round": 100}, "rounds": 2, "train": {"epochs": 1, "batch_size": 8},
        "evaluate": {"server": False},
    })
    for table in (LOADED, TRAINED, MOST_LIVE):
        table.clear()
    settings = Settings(state_dir=tmp_path, data_cache_clients=8)
    result = run_job(spec, settings, learners=2, idle_timeout=60)
    assert result["status"] == "completed"
    learners = [name for name in LOADED if name.startswith("train-")]
    assert sorted(learners) == ["train-0", "train-1"], dict(LOADED)
    assert not [name for name in LOADED if not name.startswith("train-")], "only learners load client data"
    for name in learners:
        served = {client for _, client in TRAINED[name]}
        assert set(LOADED[name]) <= served, "a learner loads only the clients it serves"
        assert MOST_LIVE[name] <= 8, f"{name} held {MOST_LIVE[name]} clients' data at once"
    assert sum(len(t) for t in TRAINED.values()) == 200  # 100 clients a round, 2 rounds
