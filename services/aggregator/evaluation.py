"""Central evaluation of a global model on the held-out test split."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over (x, y)."""
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        logits = model(xb)
        total_loss += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(dim=1) == yb).sum())
    n = max(len(x), 1)
    return total_loss / n, correct / n
