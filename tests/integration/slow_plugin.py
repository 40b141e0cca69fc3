"""A local training function that takes a long time, off the bus thread, as real training does."""

from __future__ import annotations

import time

import torch
from torch import nn

from common.jobspec import TrainSpec
from services.learner.training import train_local

SECONDS = [0.0]


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    train: TrainSpec,
    generator: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    time.sleep(SECONDS[0])  # holds the GIL-free wait a long GPU step would
    return train_local(model, x, y, train, generator, device)
