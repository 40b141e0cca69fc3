"""A complete plug-in: a model builder, a dataset loader and a local training function.

Name them from a job spec (run from the repository root, or put your package on PYTHONPATH):

    model: {entrypoint: "examples.plugins.my_model:build", options: {width: 32}}
    data:
      entrypoint: "examples.plugins.my_model:load"
      options: {num_samples: 600, num_classes: 3}
      partition: {kind: iid}
    train: {entrypoint: "examples.plugins.my_model:train", epochs: 1, lr: 0.1}
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedmq.common.jobspec import TrainSpec
from fedmq.common.seeding import numpy_rng
from fedmq.common.workloads.datasets import Dataset, stratified_split


def build(input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> nn.Module:
    """A one-hidden-layer MLP; fedmq seeds the RNG around this call, so no seeding here."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(int(np.prod(input_shape)), width),
        nn.Tanh(),
        nn.Linear(width, num_classes),
    )


def load(
    seed: int,
    test_fraction: float,
    num_samples: int = 600,
    num_classes: int = 3,
    num_features: int = 2,
    spread: float = 1.0,
) -> Dataset:
    """Gaussian blobs, one per class; deterministic in `seed` like every loader must be."""
    rng = numpy_rng(seed, "blobs")
    centres = rng.normal(0.0, 4.0, size=(num_classes, num_features))
    y = np.arange(num_samples, dtype=np.int64) % num_classes
    x = (centres[y] + rng.normal(0.0, spread, size=(num_samples, num_features))).astype(np.float32)
    train, test = stratified_split(y, test_fraction, seed)
    return Dataset(x[train], y[train], x[test], y[test], num_classes, (num_features,))


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    train: TrainSpec,
    generator: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    """Plain minibatch SGD over the shard; every shuffle draws from `generator`."""
    optimizer = torch.optim.SGD(model.parameters(), lr=train.lr, momentum=train.momentum)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    model.train()
    seen, loss_sum, correct, steps = 0, 0.0, 0, 0
    for _ in range(train.epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), train.batch_size):
            if train.max_steps is not None and steps >= train.max_steps:
                break
            batch = order[start : start + train.batch_size]
            xb, yb = x[batch].to(device), y[batch].to(device)
            optimizer.zero_grad()
            logits = model(xb)
            loss = loss_fn(logits, yb)
            (loss / len(batch)).backward()
            optimizer.step()
            seen += len(batch)
            loss_sum += float(loss.detach())
            correct += int((logits.argmax(dim=1) == yb).sum())
            steps += 1
    seen = max(seen, 1)
    return {"loss": loss_sum / seen, "accuracy": correct / seen, "steps": float(steps)}
