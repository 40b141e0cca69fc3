"""Handwritten digits (scikit-learn's bundled 8x8 images): the built-in Task, `task: digits`.

Written only against the public `fedmq` contract, as a user's Task would be:

    task:
      name: digits
      options:
        model: {name: mlp, hidden: [128]}        # or {name: cnn, channels: [16, 32]}
                                                 # batch_norm: true adds BatchNorm after each layer
        test_fraction: 0.2                       # held out for the server's evaluation
        partition: {kind: dirichlet, alpha: 0.5} # iid | dirichlet | shards
        own_validation: 0.2                      # clients validate on a fifth of their own examples

A loss-level Task: fedmq runs the training loop, and evaluation is the mean loss and accuracy.
Each client also holds validation data: a slice of the held-out split, or with own_validation a share
of its own examples.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import fedmq
from fedmq.data import DirichletPartition, Partition, PartitionSpec, partition, stratified_split

INPUT_SHAPE = (1, 8, 8)
NUM_CLASSES = 10


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Mlp(_Options):
    name: Literal["mlp"] = "mlp"
    hidden: list[Annotated[int, Field(gt=0)]] = [128]
    batch_norm: bool = False


class Cnn(_Options):
    name: Literal["cnn"] = "cnn"
    channels: list[Annotated[int, Field(gt=0)]] = [16, 32]
    batch_norm: bool = False


class DigitsOptions(_Options):
    model: Annotated[Mlp | Cnn, Field(discriminator="name")] = Mlp()
    test_fraction: float = Field(0.2, gt=0, lt=1)
    partition: Partition = DirichletPartition()
    # > 0: each client's validation data is this fraction of its own examples (its own label mix,
    # as personalization is judged), kept out of its training data; 0: a slice of the held-out split.
    own_validation: float = Field(0.0, ge=0, lt=1)


class Digits(fedmq.Task):
    """Classify 8x8 digit images; 1,437 training and 360 held-out images at test_fraction 0.2."""

    Options = DigitsOptions
    objective = fedmq.Objective("server.accuracy", "max")
    lean_memory = True  # an MLP or a CNN: one gradient per parameter, no views kept
    options: DigitsOptions

    def build_model(self) -> nn.Module:
        spec = self.options.model
        if isinstance(spec, Cnn):
            return cnn(INPUT_SHAPE, NUM_CLASSES, spec.channels, spec.batch_norm)
        return mlp(INPUT_SHAPE, NUM_CLASSES, spec.hidden, spec.batch_norm)

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        x, y, test = _standardised(self.options.test_fraction, ctx.seed)
        train = _train_indices(self.options.test_fraction, ctx.seed)
        parts = _parts(self.options.test_fraction, self.options.partition, ctx.seed, ctx.num_clients)
        mine = train[parts[ctx.client]]
        val = np.array_split(test, ctx.num_clients)[ctx.client]
        if self.options.own_validation > 0:  # a seeded draw of the client's own, out of its training
            order = ctx.rng("own_validation", ctx.client).permutation(len(mine))
            held = min(round(len(mine) * self.options.own_validation), len(mine) - 1)  # one left to train
            val, mine = np.sort(mine[order[:held]]), np.sort(mine[order[held:]])
        return fedmq.ClientData(
            train=(torch.from_numpy(x[mine]), torch.from_numpy(y[mine])),
            val=(torch.from_numpy(x[val]), torch.from_numpy(y[val])),
        )

    def check_job(self, ctx: fedmq.DataContext) -> None:
        """The partition learners will compute, computed here: more clients than training images,
        or more shards than images, is refused before the job runs (the same ConfigError)."""
        _parts(self.options.test_fraction, self.options.partition, ctx.seed, ctx.num_clients)

    def load_server_data(self, ctx: fedmq.DataContext) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, test = _standardised(self.options.test_fraction, ctx.seed)
        return torch.from_numpy(x[test]), torch.from_numpy(y[test])

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        x, y = batch
        logits = model(x)
        accuracy = (logits.argmax(dim=1) == y).float().mean()  # argmax has no gradient: nothing to detach
        return nn.functional.cross_entropy(logits, y), {"accuracy": accuracy}


def mlp(
    input_shape: tuple[int, ...], num_classes: int, hidden: list[int], batch_norm: bool = False
) -> nn.Sequential:
    """Flatten, then Linear(+BatchNorm, without the bias it cancels)+ReLU per hidden width, then a
    Linear to the class logits."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers.append(nn.Linear(width, h, bias=not batch_norm))
        layers += [nn.BatchNorm1d(h), nn.ReLU()] if batch_norm else [nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(
    input_shape: tuple[int, ...], num_classes: int, channels: list[int], batch_norm: bool = False
) -> nn.Sequential:
    """Conv3x3(+BatchNorm, without the bias it cancels)+ReLU(+MaxPool2 while the image is at least
    2x2) per channel count, then Linear."""
    in_channels, height, width = input_shape
    layers: list[nn.Module] = []
    for out_channels in channels:
        layers.append(nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=not batch_norm))
        layers += [nn.BatchNorm2d(out_channels), nn.ReLU()] if batch_norm else [nn.ReLU()]
        if height >= 2 and width >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        in_channels = out_channels
    layers += [nn.Flatten(), nn.Linear(in_channels * height * width, num_classes)]
    return nn.Sequential(*layers)


@functools.lru_cache(maxsize=4)
def _standardised(test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All images standardised per pixel with the training split's statistics; labels; test indices.

    (SGD on raw [0, 1] pixels converges several times slower.) Cached: every client of a
    process shares one copy, read-only.
    """
    pixels, labels = _raw_digits()
    x = (pixels / 16.0).astype(np.float32).reshape(-1, *INPUT_SHAPE)
    y = labels.astype(np.int64)
    train, test = stratified_split(y, test_fraction, seed)
    mean = x[train].mean(axis=0, keepdims=True)
    std = x[train].std(axis=0, keepdims=True)
    x = ((x - mean) / np.where(std > 1e-6, std, 1.0)).astype(np.float32)
    for array in (x, y, test):
        array.setflags(write=False)
    return x, y, test


def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 images' 64 pixel counts (0-16, float64) and their labels: scikit-learn's bundled
    file, read as its `load_digits` reads it, without importing scikit-learn, which took 78 MiB
    of every process that loads the Task (an aggregator's, each learner's) for a 0.5 MB table.
    Where that file is not found (another layout of the package), `load_digits` itself."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if bundled.is_file():
            table = np.loadtxt(bundled, delimiter=",")
            return table[:, :-1], table[:, -1].astype(int)
    from sklearn.datasets import load_digits

    raw = load_digits()
    return raw.data, raw.target


@functools.lru_cache(maxsize=4)
def _train_indices(test_fraction: float, seed: int) -> np.ndarray:
    _, y, test = _standardised(test_fraction, seed)
    return np.setdiff1d(np.arange(len(y), dtype=np.int64), test, assume_unique=True)


@functools.lru_cache(maxsize=8)
def _parts(test_fraction: float, kind: PartitionSpec, seed: int, num_clients: int) -> list[np.ndarray]:
    """Each client's positions within the training split (the partition specs are frozen, hashable)."""
    _, y, _ = _standardised(test_fraction, seed)
    return partition(y[_train_indices(test_fraction, seed)], num_clients, kind, seed)
