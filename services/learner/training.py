"""Local training of one client: all torch code of the learner, nothing of the bus."""

from __future__ import annotations

import torch
from torch import nn

from fedmq.common.jobspec import TrainSpec


def make_optimizer(model: nn.Module, spec: TrainSpec) -> torch.optim.Optimizer:
    if spec.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
    )


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    train: TrainSpec,
    generator: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    """Minibatch training for `train.epochs` (or `train.max_steps`); returns last-epoch loss and accuracy."""
    model.train()
    optimizer = make_optimizer(model, train)
    x, y = x.to(device), y.to(device)
    steps = 0
    loss_sum, correct, seen = 0.0, 0, 0
    for _ in range(train.epochs):
        loss_sum, correct, seen = 0.0, 0, 0
        order = torch.randperm(len(x), generator=generator).to(device)
        for start in range(0, len(x), train.batch_size):
            idx = order[start : start + train.batch_size]
            xb, yb = x[idx], y[idx]
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            loss = nn.functional.cross_entropy(logits, yb)
            loss.backward()
            optimizer.step()
            loss_sum += float(loss.detach()) * len(idx)
            correct += int((logits.detach().argmax(dim=1) == yb).sum())
            seen += len(idx)
            steps += 1
            if train.max_steps is not None and steps >= train.max_steps:
                return {"loss": loss_sum / seen, "accuracy": correct / seen, "steps": steps}
    return {"loss": loss_sum / max(seen, 1), "accuracy": correct / max(seen, 1), "steps": steps}
