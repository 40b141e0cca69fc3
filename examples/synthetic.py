"""A Task whose clients' data are made from their ids: any number of clients, no data set.

Each client holds 16 points of y = x·w* + noise (8 features), drawn from (seed, client); the
server's held-out data is 256 more. For simulations of very many clients (`examples/synthetic.yaml`,
benchmarks/many_clients.py): a loss-level Task, so `train.fuse` trains a round's clients together.
"""

from __future__ import annotations

import torch
from torch import nn

import fedmq

FEATURES = 8
TRUE_WEIGHTS = torch.arange(FEATURES, dtype=torch.float32).reshape(FEATURES, 1) / FEATURES


class Synthetic(fedmq.Task):
    """Linear regression on points made from the client's id."""

    def build_model(self) -> nn.Module:
        return nn.Linear(FEATURES, 1)

    def load_data(self, ctx: fedmq.DataContext) -> tuple[torch.Tensor, torch.Tensor]:
        return _points(ctx.seed * 1_000_003 + ctx.client, 16)

    def load_server_data(self, ctx: fedmq.DataContext) -> tuple[torch.Tensor, torch.Tensor]:
        return _points(ctx.seed * 1_000_003 - 1, 256)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def _points(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=generator)
    return x, x @ TRUE_WEIGHTS + 0.1 * torch.randn(count, 1, generator=generator)
