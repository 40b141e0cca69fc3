"""User code that raises on purpose, one function per phase, for tests of how a job fails.

Each raises an ordinary exception (never fedmq's own), as a user's bug would. Which service
calls it is told apart by the calling thread: a learner builds and trains on its `train-N`
thread, the aggregator on its bus thread. That holds in one process and in service processes.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from fedmq.common.jobspec import TrainSpec
from fedmq.common.workloads.datasets import Dataset


def _on_learner() -> bool:
    return threading.current_thread().name.startswith("train-")


def _mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))


def broken_model(*, input_shape: tuple[int, ...], num_classes: int, **_: Any) -> nn.Module:
    raise ValueError("width must be positive, got -3")


def model_broken_on_learners(*, input_shape: tuple[int, ...], num_classes: int, **_: Any) -> nn.Module:
    if _on_learner():
        raise ImportError("libcudnn.so.9: cannot open shared object file")
    return _mlp(input_shape, num_classes)


def broken_data(*, seed: int, test_fraction: float, **_: Any) -> Dataset:
    raise KeyError("shard 'digits-7' is not in the bucket")


class _FailsEvaluation(nn.Module):
    """An MLP whose `evaluations`-th forward pass over a full test batch raises."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, fail_at: int) -> None:
        super().__init__()
        self.net = _mlp(input_shape, num_classes)
        self.fail_at = fail_at
        self.evaluations = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and len(x) > 2:  # 2: fedmq's shape check when the model is built
            self.evaluations += 1
            if self.evaluations >= self.fail_at:
                raise FloatingPointError("overflow in the user's forward pass")
        return self.net(x)


def model_failing_evaluation(
    *, input_shape: tuple[int, ...], num_classes: int, fail_at: int = 1
) -> nn.Module:
    """fail_at=1: the initial model's evaluation raises; 2: the one after round 1 closes."""
    return _FailsEvaluation(input_shape, num_classes, fail_at)


def broken_train(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainSpec,
    generator: torch.Generator, device: torch.device,
) -> dict[str, float]:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
