"""A local training function that fails for client 0: how the round policy meets a broken client."""

from __future__ import annotations

import torch
from torch import nn

from common.jobspec import TrainSpec
from services.learner.training import train_local


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    train: TrainSpec,
    generator: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    if len(x) == FAIL_SIZE[0]:
        raise RuntimeError("simulated out-of-memory on this client")
    return train_local(model, x, y, train, generator, device)


FAIL_SIZE = [-1]  # the shard size to fail on; set by the test
