"""BatchNorm for fused training: the same arithmetic in plain tensor operations, one client per row.

Under vmap torch's own batch norm runs as one kernel over the group's clients side by side, and a
client's last bits then depend on its place in the group (measured: a BatchNorm bias moved by
4e-9 between place 0 of two clients and place 2 of three). A client's bits must not depend on its
company (fused.py), so while a group trains, each BatchNorm module computes its statistics with
means over its own rows instead:

    training (or no running statistics)   mean and biased variance over every dimension but the
                                          channels; running mean and variance updated with the
                                          module's momentum (None: the cumulative average) and the
                                          unbiased variance, its batch count + 1, as torch does
    evaluation                            the running statistics

Within float tolerance of torch's kernel (6e-8 on a gradient in the test), not bit for bit: fused
training is within tolerance of the sequential loop anyway.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["BatchOfOne", "rows_batch_norm", "unbatched_buffers"]


class BatchOfOne(ValueError):
    """A batch with one value per channel in training, which BatchNorm refuses (as torch does).
    Every client of a fused step has the same batch shape: each of them fails, and no other."""


def _plain_batch_norm(module: nn.Module) -> bool:
    """A BatchNorm whose forward is torch's own (BatchNorm1d/2d/3d and subclasses that keep it)."""
    return isinstance(module, _BatchNorm) and type(module).forward is _BatchNorm.forward


def unbatched_buffers(model: nn.Module) -> str | None:
    """The first module with buffers that fused training cannot keep per client (not a plain
    BatchNorm: SyncBatchNorm, a module of the user's own), as `name (Type)`; None if none."""
    for name, module in model.named_modules():
        if any(True for _ in module.buffers(recurse=False)) and not _plain_batch_norm(module):
            return f"{name or 'the model'} ({type(module).__name__})"
    return None


@contextlib.contextmanager
def rows_batch_norm(model: nn.Module) -> Iterator[None]:
    """While inside, `model`'s BatchNorm modules compute with `_forward` (their own forward after)."""
    patched = [m for m in model.modules() if _plain_batch_norm(m)]
    for module in patched:
        module.forward = types.MethodType(_forward, module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _forward(self: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    self._check_input_dim(x)
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    batch_stats = self.training or self.running_mean is None
    if batch_stats:
        count = x.numel() // x.shape[1]
        if count < 2 and self.training:  # torch's own words
            raise BatchOfOne(
                f"Expected more than 1 value per channel when training, got input size {x.size()}")
        mean = x.mean(dims)
        centred = x - mean.reshape(shape)
        var = (centred * centred).mean(dims)
        if self.training and self.track_running_stats:
            _update_running(self, mean.detach(), var.detach() * (count / (count - 1)))
    else:
        mean, var = _running(self)
        centred = x - mean.reshape(shape)
    out = centred * torch.rsqrt(var + self.eps).reshape(shape)
    if self.weight is not None:
        out = out * self.weight.reshape(shape)
    if self.bias is not None:
        out = out + self.bias.reshape(shape)
    return out


def _running(self: _BatchNorm) -> tuple[Any, Any]:
    return self.running_mean, self.running_var


def _update_running(self: _BatchNorm, mean: torch.Tensor, unbiased: torch.Tensor) -> None:
    """As torch updates them: the batch count + 1, then each statistic moved by the momentum (None:
    1 / the batch count, the cumulative average)."""
    assert self.num_batches_tracked is not None and self.running_mean is not None
    assert self.running_var is not None
    with torch.no_grad():
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor: Any = 1.0 / self.num_batches_tracked.to(mean.dtype)
        else:
            factor = self.momentum
        self.running_mean.mul_(1 - factor).add_(mean * factor)
        self.running_var.mul_(1 - factor).add_(unbiased * factor)
