"""The Task's loss as a function of weights, for torch.func: fused training and DP-SGD use it.

`loss` may return a scalar tensor, or (scalar tensor, dict of metrics); `split_loss` checks
that, and `loss_with_aux` calls the loss with another set of weights (functional_call) and
returns its metrics as tensors, as `torch.func.grad(..., has_aux=True)` wants them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from fedmq.common.task.contract import Task

__all__ = ["LossCall", "LossError", "loss_with_aux", "split_loss", "unsqueeze"]


class LossError(TypeError):
    """`loss` returned something other than a scalar tensor, optionally with a dict of metrics."""


class LossCall(nn.Module):
    """The Task's loss as a module, so functional_call can swap the model's weights for others."""

    def __init__(self, task: Task, model: nn.Module) -> None:
        super().__init__()
        self.task = task
        self.model = model

    def forward(self, batch: Any) -> Any:
        return self.task.loss(self.model, batch)  # type: ignore[attr-defined]


def loss_with_aux(
    call: LossCall, params: Mapping[str, torch.Tensor], batch: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of `batch` with the model's parameters `params` (by name), and {"loss": the loss,
    each metric: a scalar tensor}, detached."""
    out = torch.func.functional_call(call, {f"model.{n}": p for n, p in params.items()}, (batch,))
    loss, metrics = split_loss(out)
    aux = {"loss": loss.detach()}
    for name, value in metrics.items():
        tensor = (value.detach() if isinstance(value, torch.Tensor)
                  else torch.tensor(float(value), device=loss.device))
        aux[name] = tensor.reshape(())
    return loss, aux


def unsqueeze(example: Any) -> Any:
    """One example (tensors without their batch dimension) as a batch of one."""
    if isinstance(example, torch.Tensor):
        return example.unsqueeze(0)
    if isinstance(example, tuple | list):
        return type(example)(unsqueeze(e) for e in example)
    return {k: unsqueeze(v) for k, v in example.items()}


def split_loss(out: Any) -> tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]:
    """`loss` → (scalar tensor, metrics); LossError for anything else."""
    metrics: Any = {}
    if isinstance(out, tuple) and len(out) == 2:
        out, metrics = out
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise LossError(
            f"loss() must return a scalar tensor, or (scalar tensor, dict of metrics); got {_describe(out)}"
        )
    if not isinstance(metrics, Mapping):
        raise LossError(f"loss() metrics must be a dict of name -> tensor or float, got {_describe(metrics)}")
    return (out if out.dim() == 0 else out.reshape(())), metrics


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
