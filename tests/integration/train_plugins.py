"""Local training functions that misbehave on purpose, for tests of the round policy.

Each wraps fedmq's own trainer; module-level knobs say when to misbehave (set by a test,
or by environment variable in a learner process).
"""

from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn

from fedmq.common.jobspec import TrainSpec
from fedmq.services.learner.training import train_local

FAIL_SIZE = [-1]  # `failing`: the shard size to fail on
SECONDS = [0.0]  # `slow`: seconds to sleep before training (or FEDMQ_TEST_TRAIN_SLEEP_S)
HANG = {"size": -1, "seconds": 0.0}  # `hang_once`: the first attempt at this shard size sleeps
_hung: set[int] = set()
_lock = threading.Lock()


def failing(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainSpec,
    generator: torch.Generator, device: torch.device,
) -> dict[str, float]:
    if len(x) == FAIL_SIZE[0]:
        raise RuntimeError("simulated out-of-memory on this client")
    return train_local(model, x, y, train, generator, device)


def slow(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainSpec,
    generator: torch.Generator, device: torch.device,
) -> dict[str, float]:
    time.sleep(SECONDS[0] or float(os.environ.get("FEDMQ_TEST_TRAIN_SLEEP_S", "0")))
    return train_local(model, x, y, train, generator, device)


def hang_once(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainSpec,
    generator: torch.Generator, device: torch.device,
) -> dict[str, float]:
    with _lock:
        first = len(x) == HANG["size"] and len(x) not in _hung
        _hung.add(len(x))
    if first:
        time.sleep(HANG["seconds"])
    return train_local(model, x, y, train, generator, device)


def reset() -> None:
    FAIL_SIZE[0], SECONDS[0] = -1, 0.0
    _hung.clear()
    HANG.update(size=-1, seconds=0.0)
