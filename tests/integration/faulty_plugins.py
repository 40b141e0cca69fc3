"""A Task whose user code raises on purpose, at the phase its `fail` option names, for tests of
how a job fails.

Each raises an ordinary exception (never fedmq's own), as a user's bug would. Where it runs
is told apart by the calling thread: a learner builds and trains on its `train-N` thread, the
aggregator on its bus thread. That holds in one process and in service processes.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

import fedmq
from fedmq.common.task.loop import train_with_loss
from fedmq.tasks.digits import Digits, DigitsOptions

TASK = "tests.integration.faulty_plugins:Faulty"


class FaultyOptions(DigitsOptions):
    fail: Literal["", "build_model", "build_model_on_learners", "model_differs_on_learners",
                  "load_server_data", "load_data", "evaluate", "train", "diverge"] = ""
    fail_at: int = Field(1, ge=1, description="evaluate: the server evaluation that raises (1: round 0's)")


class Faulty(Digits):
    Options = FaultyOptions
    options: FaultyOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.evaluations = 0

    def build_model(self) -> nn.Module:
        if self.options.fail == "build_model":
            raise ValueError("width must be positive, got -3")
        if self.options.fail == "build_model_on_learners" and _on_learner():
            raise ImportError("libcudnn.so.9: cannot open shared object file")
        if self.options.fail == "model_differs_on_learners" and _on_learner():
            return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))  # e.g. sized from local files
        return super().build_model()

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        if self.options.fail == "load_data":
            raise KeyError("shard 'digits-7' is not in the bucket")
        return super().load_data(ctx)

    def load_server_data(self, ctx: fedmq.DataContext) -> Any:
        if self.options.fail == "load_server_data":
            raise KeyError("shard 'digits-test' is not in the bucket")
        return super().load_server_data(ctx)

    def evaluate(self, model: nn.Module, data: Any, ctx: fedmq.EvalContext) -> Any:
        self.evaluations += 1
        if self.options.fail == "evaluate" and self.evaluations >= self.options.fail_at:
            raise FloatingPointError("overflow in the user's forward pass")
        return super().evaluate(model, data, ctx)

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        if self.options.fail == "train":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        result = train_with_loss(self, model, data, ctx)
        if self.options.fail == "diverge":
            with torch.no_grad():
                next(iter(model.parameters())).fill_(float("inf"))
        return result


def faulty(fail: str, **options: Any) -> dict[str, Any]:
    """The spec change that makes a small_job's Task fail at `fail`."""
    return {"task": {"name": TASK, "options": {"fail": fail, **options}}}


def _on_learner() -> bool:
    return threading.current_thread().name.startswith("train-")
