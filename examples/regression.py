"""Regression on scikit-learn's bundled diabetes data: an MLP, float targets, mse / mae / r2.

442 patients, 10 features, the target a measure of disease progression a year later (25-346).
A held-out split (test_fraction) is the server's evaluation data; the rest is split iid over
the clients, and each client also holds a slice of the held-out split as its validation data.
Features and target are standardised with the training split's statistics (the same numbers
in every process: the data ships with scikit-learn and the split is seeded).

A loss-level Task: fedmq runs the training loop (the spec's `train` section) on the mean
squared error of the standardised target. `evaluate` reports in the target's own units:

    mse, mae   means over the split: combined over clients by example-weighted mean, exactly
    r2         1 - SSE/SST over the whole split given, SST about that split's own mean

An R² averaged over batches or clients is not the R² of their union (each part is measured
about its own mean), so `evaluate` never averages it: it computes SSE and SST over the whole
split at once, and the spec's objective and acceptance read `server.r2`, which is the R² of the
whole held-out split (scikit-learn's r2_score). A federated `r2` is the example-weighted mean
of the clients' own R², a different number; mse and mae combine exactly either way.
"""

from __future__ import annotations

import functools
from typing import Annotated

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import fedmq
from fedmq.data import IidPartition, partition, random_split

Split = tuple[torch.Tensor, torch.Tensor]


class RegressionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    hidden: list[Annotated[int, Field(gt=0)]] = [32]
    test_fraction: float = Field(0.2, gt=0, lt=1)


class Regression(fedmq.Task):
    """An MLP regressor on the diabetes data; metrics mse, mae and r2 in the target's units."""

    Options = RegressionOptions
    objective = fedmq.Objective("server.mse", "min")
    options: RegressionOptions

    def build_model(self) -> nn.Module:
        layers: list[nn.Module] = []
        width = NUM_FEATURES
        for h in self.options.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        return nn.Sequential(*layers)

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        data = _prepared(self.options.test_fraction, ctx.seed)
        mine = data.train[_parts(self.options.test_fraction, ctx.seed, ctx.num_clients)[ctx.client]]
        val = np.array_split(data.test, ctx.num_clients)[ctx.client]
        return fedmq.ClientData(train=data.rows(mine), val=data.rows(val))

    def load_server_data(self, ctx: fedmq.DataContext) -> Split:
        data = _prepared(self.options.test_fraction, ctx.seed)
        return data.rows(data.test)

    def loss(self, model: nn.Module, batch: Split) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: Split, ctx: fedmq.EvalContext) -> dict[str, float]:
        x, y = data
        model.eval()
        prepared = _prepared(self.options.test_fraction, ctx.seed)
        return regression_metrics(prepared.unscale(model(x)), prepared.unscale(y))


def regression_metrics(predicted: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """mse, mae and r2 (1 - SSE/SST about the target's mean) over all of `target` at once."""
    err = (predicted - target).double()
    sse = float(err.pow(2).sum())
    sst = float((target.double() - target.double().mean()).pow(2).sum())
    n = err.numel()
    return {"mse": sse / n, "mae": float(err.abs().sum()) / n, "r2": 1.0 - sse / sst if sst > 0 else 0.0}


NUM_FEATURES = 10


class _Prepared:
    """The diabetes data standardised with the training split's statistics, and the split."""

    def __init__(self, test_fraction: float, seed: int) -> None:
        from sklearn.datasets import load_diabetes

        raw = load_diabetes()
        x, y = raw.data.astype(np.float64), raw.target.astype(np.float64).reshape(-1, 1)
        self.train, self.test = random_split(len(y), test_fraction, seed, "diabetes")
        self.x_mean, self.x_std = x[self.train].mean(axis=0), x[self.train].std(axis=0)
        self.y_mean, self.y_std = float(y[self.train].mean()), float(y[self.train].std())
        self.x = torch.from_numpy(((x - self.x_mean) / self.x_std).astype(np.float32))
        self.y = torch.from_numpy(((y - self.y_mean) / self.y_std).astype(np.float32))

    def rows(self, idx: np.ndarray) -> Split:
        index = torch.from_numpy(idx)
        return self.x[index], self.y[index]

    def unscale(self, y: torch.Tensor) -> torch.Tensor:
        """Standardised targets back in the target's own units."""
        return y.double() * self.y_std + self.y_mean


@functools.lru_cache(maxsize=4)
def _prepared(test_fraction: float, seed: int) -> _Prepared:
    return _Prepared(test_fraction, seed)


@functools.lru_cache(maxsize=8)
def _parts(test_fraction: float, seed: int, num_clients: int) -> list[np.ndarray]:
    """Each client's positions within the training split: an equal, seeded iid share."""
    size = len(_prepared(test_fraction, seed).train)
    return partition(np.zeros(size, dtype=np.int64), num_clients, IidPartition(), seed)
