"""A local training function that takes a long time, off the bus thread, as real training does."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from common.jobspec import TrainSpec
from services.learner.training import train_local

SECONDS = [0.0]  # set by in-process tests; processes read FEDMQ_TEST_TRAIN_SLEEP_S


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    train: TrainSpec,
    generator: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    time.sleep(SECONDS[0] or float(os.environ.get("FEDMQ_TEST_TRAIN_SLEEP_S", "0")))
    return train_local(model, x, y, train, generator, device)
