"""A local training function whose first attempt at one client hangs past the round's deadline."""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from common.jobspec import TrainSpec
from services.learner.training import train_local

HANG = {"size": -1, "seconds": 0.0}
_hung: set[int] = set()
_lock = threading.Lock()


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    train: TrainSpec,
    generator: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    with _lock:
        first = len(x) == HANG["size"] and len(x) not in _hung
        _hung.add(len(x))
    if first:
        time.sleep(HANG["seconds"])
    return train_local(model, x, y, train, generator, device)


def reset() -> None:
    _hung.clear()
    HANG.update(size=-1, seconds=0.0)
