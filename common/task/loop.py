"""fedmq's local training loop for a loss-level Task, and the default evaluation from its loss.

    for each epoch:                       (or until train.max_steps)
        order = randperm(n, ctx.generator)            the client's own stream
        for batch in order's batches:
            loss[, metrics] = task.loss(model, batch)
            (+ mu/2 * ||w - w_global||^2 when the strategy asks for a proximal term)
            backward, (+ c - c_i on every gradient when the strategy is SCAFFOLD), optimizer step
            (train.dp_sgd: each example's gradient clipped, their sum noised instead: dpsgd.py)

Metrics are accumulated on the device and read once at the end (no host sync per step):
the last epoch's example-weighted means of the loss and of every metric `loss` returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedmq.common.heap import LARGE_MODEL_BYTES
from fedmq.common.strategy.contract import PROXIMAL_MU
from fedmq.common.task.batches import Source, batch_size_of, source, to_device
from fedmq.common.task.contexts import EvalContext, EvalResult, TrainContext, TrainResult
from fedmq.common.task.dpsgd import PrivateGradients, epsilon_spent
from fedmq.common.task.functional import split_loss
from fedmq.common.task.layers import proximal_names
from fedmq.common.task.optimizers import Adam, Sgd, make_optimizer
from fedmq.common.task.scaffold import Controls

if TYPE_CHECKING:
    from fedmq.common.task.contract import Task

__all__ = ["PROXIMAL_MU", "evaluate_with_loss", "train_with_loss"]

# From this size of parameters on (heap.py's large model), each steps in the backward pass
# (optimizers.in_backward) when the Task allows it (Task.lean_memory): the learner's peak is then the
# model and one layer's gradient, not the model twice. Below it, a hook per parameter per step would
# cost more than the memory it saves. The same bits either way.
STEP_IN_BACKWARD_BYTES = LARGE_MODEL_BYTES


def train_with_loss(task: Task, model: nn.Module, data: Any, ctx: TrainContext) -> TrainResult:
    """Train `model` in place on one client's data with the Task's loss; see the module docstring."""
    settings = ctx.train
    src = on_device(source(data, "training data"), ctx.device)
    resident = _resident(src, ctx.device)
    model.train()
    named = list(model.named_parameters())  # one walk of the model for the names and the optimizer
    names = [name for name, _ in named]
    optimizer = make_optimizer([p for _, p in named], settings)
    if settings.keep_optimizer_state:
        optimizer.load_entries(ctx.state, names)
    mu = float(ctx.config.get(PROXIMAL_MU, 0.0))
    anchors = _anchors(model, ctx.global_weights, ctx.device, proximal_names(model, settings.personal)) \
        if mu > 0 else []
    controls = Controls.for_round(model, ctx)
    if controls is not None and settings.personal is not None and settings.personal.method == "fedper":
        raise ValueError("personalize fedper cannot train with SCAFFOLD's control variates: they would mix "
                         "each client's own layers into the shared ones")
    private = _private(task, model, src, ctx)
    early = (private is None and controls is None and task.lean_memory
             and _parameter_bytes(optimizer.params) >= STEP_IN_BACKWARD_BYTES)
    steps, sums, seen = 0, _Sums(ctx.device), 0
    with optimizer.in_backward() if early else contextlib.nullcontext():
        for epoch in range(settings.epochs):
            sums, seen = _Sums(ctx.device), 0
            keep = epoch == settings.epochs - 1 or settings.max_steps is not None  # the result's epoch?
            for batch in src.batches(settings.batch_size, ctx.generator):
                batch = batch if resident else to_device(batch, ctx.device)
                size = batch_size_of(batch)
                optimizer.zero_grad(set_to_none=True)
                if private is not None:  # each example's gradient clipped, their sum noised
                    loss, metrics = private.backward(batch)
                    _add_proximal(anchors, mu)
                else:
                    loss, metrics = split_loss(task.loss(model, batch))  # type: ignore[attr-defined]
                    total = loss + mu / 2 * sum((p - a).pow(2).sum() for p, a in anchors) if anchors else loss
                    backward(total)
                if controls is not None:
                    controls.correct()
                optimizer.step()
                if keep:
                    sums.add(loss, metrics, size)
                seen += size
                steps += 1
                if settings.max_steps is not None and steps >= settings.max_steps:
                    result = _result(seen, sums, controls, _spent(src, ctx, steps))
                    return _finished(optimizer, names, ctx, result)
    return _finished(optimizer, names, ctx, _result(seen, sums, controls, _spent(src, ctx, steps)))


def backward(loss: torch.Tensor) -> None:
    """`loss.backward()`, the same gradients, without its Python checks for the common case.

    A plain scalar float tensor that requires grad goes straight to autograd's engine with a
    gradient of one, as `torch.autograd.backward` sends it after its checks: measured here, those
    checks were a sixth of a small model's step (~50 µs of ~300). Anything else (a tensor
    subclass, a loss that needs no grad, a torch function mode in force) takes `backward()` itself,
    to fail or dispatch as it does."""
    if (type(loss) is not torch.Tensor or not loss.requires_grad or loss.dim() != 0
            or not loss.dtype.is_floating_point or _ENGINE is None
            or torch.overrides.has_torch_function_unary(loss)):  # a TorchFunctionMode sees backward()
        loss.backward()
        return
    _ENGINE((loss,), (torch.ones_like(loss, memory_format=torch.preserve_format),), False, False, (),
            allow_unreachable=True, accumulate_grad=True)


# The call into autograd's engine that torch.autograd.backward makes after its checks (it keeps the
# context the engine's device threads need); None where this torch has none: backward() then.
_ENGINE = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _finished(optimizer: Sgd | Adam, names: list[str], ctx: TrainContext, result: TrainResult) -> TrainResult:
    """`result`, the optimizer's state kept in the client's state first when the spec asks for it.
    The model is left without gradients (a model's worth of memory no one reads again)."""
    if ctx.train.keep_optimizer_state:
        ctx.state.update(optimizer.state_entries(names))
    optimizer.zero_grad(set_to_none=True)
    return result


def _parameter_bytes(params: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def _private(task: Task, model: nn.Module, src: Source, ctx: TrainContext) -> PrivateGradients | None:
    """DP-SGD's gradients when the spec asks for them; TypeError for data whose sampling rate is unknown."""
    if ctx.train.dp_sgd is None:
        return None
    if not src.indexable:
        raise TypeError(
            "train.dp_sgd needs data fedmq cuts into batches itself (tensors, a dict of tensors or a "
            "map-style Dataset): with an iterable such as a DataLoader its sampling rate is unknown"
        )
    return PrivateGradients(task, model, ctx)


@torch.no_grad()
def _add_proximal(anchors: list[tuple[torch.Tensor, torch.Tensor]], mu: float) -> None:
    """FedProx's gradient mu·(w − w_global), added to a private gradient (it depends on no example)."""
    for p, a in anchors:
        if p.grad is not None:
            p.grad.add_(p - a, alpha=mu)


def _spent(src: Source, ctx: TrainContext, steps: int) -> dict[str, float]:
    """DP-SGD's ε so far (dpsgd.py); {} without DP-SGD."""
    dp = ctx.train.dp_sgd
    if dp is None or src.size is None:
        return {}
    return epsilon_spent(dp, ctx.train.batch_size, src.size, steps, ctx.round)


@torch.no_grad()
def evaluate_with_loss(task: Task, model: nn.Module, data: Any, ctx: EvalContext) -> EvalResult:
    """The mean loss and the mean of each metric `loss` returns, over `data` in order."""
    src = on_device(source(data, "evaluation data"), ctx.device)
    model.eval()
    sums, seen = _Sums(ctx.device), 0
    for batch in src.batches(ctx.batch_size, None):
        batch = to_device(batch, ctx.device)
        size = batch_size_of(batch)
        loss, metrics = split_loss(task.loss(model, batch))  # type: ignore[attr-defined]
        sums.add(loss, metrics, size)
        seen += size
    return EvalResult(seen, sums.means(seen))


def _result(seen: int, sums: _Sums, controls: Controls | None, spent: dict[str, float]) -> TrainResult:
    """The round's result, with SCAFFOLD's control deltas as extras when it ran, and DP-SGD's ε."""
    extras = controls.extras() if controls and controls.steps else {}
    return TrainResult(seen, {**sums.means(seen), **spent}, extras)


def on_device(src: Source, device: torch.device) -> Source:
    """Tensor data moves to the device once per call; datasets and iterables move batch by batch."""
    data = src.data
    if isinstance(data, torch.Tensor | tuple | list | Mapping) and src.indexable and device.type != "cpu":
        return Source(to_device(data, device), src.size, src.indexable)
    return src


def _resident(src: Source, device: torch.device) -> bool:
    """Whether every batch cut from `src` is on `device` already (tensors there, cut by fedmq)."""
    data = src.data
    tensors = (data.values() if isinstance(data, Mapping) else data if isinstance(data, tuple | list)
               else [data])
    return src.indexable and all(isinstance(t, torch.Tensor) and t.device == device for t in tensors)


class _Sums:
    """Example-weighted sums of the loss and metrics, kept on the device until `means`.

    Each step's values are only kept (detached): a step's multiply-adds in float64, five small
    operations a metric, were a tenth of a small model's step. `means` makes each term value × size
    in float64 and adds them in step order, the same bits as adding them step by step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.values: dict[str, list[torch.Tensor | float]] = {}
        self.sizes: dict[str, list[int]] = {}

    def add(self, loss: torch.Tensor, metrics: Mapping[str, torch.Tensor | float], size: int) -> None:
        for name, value in {"loss": loss, **metrics}.items():  # a metric named loss replaces it
            if name not in self.values:
                self.values[name], self.sizes[name] = [], []
            if isinstance(value, torch.Tensor):  # a value with a graph is kept without it
                self.values[name].append(value.detach() if value.requires_grad else value)
            else:
                self.values[name].append(float(value))
            self.sizes[name].append(size)

    def means(self, seen: int) -> dict[str, float]:
        if not self.values or seen == 0:
            return {}
        names = list(self.values)
        terms = self._all_terms(names)
        out, at = {}, 0
        for name in names:
            total = 0.0
            for term in terms[at:at + len(self.sizes[name])]:
                total += term
            at += len(self.sizes[name])
            out[name] = total / seen
        return out

    def _all_terms(self, names: list[str]) -> list[float]:
        """Every step's value × size, name after name, with one host sync.

        The common case (every value a 0-dim float tensor of one dtype and device) is one stack
        read as Python floats and multiplied there: a float64 product as `_terms` makes it (a float
        tensor converts to float64 exactly either way), in two operations instead of about six a name."""
        values = [v for n in names for v in self.values[n]]
        if all(type(v) is torch.Tensor and v.dim() == 0 and v.is_floating_point() for v in values) \
                and len({(v.dtype, v.device) for v in values}) == 1:  # type: ignore[union-attr]
            read = torch.stack(values).tolist()  # type: ignore[arg-type]  # the one host sync
            sizes = [size for n in names for size in self.sizes[n]]
            return [value * size for value, size in zip(read, sizes, strict=True)]
        return list(torch.cat([self._terms(n) for n in names]).cpu().tolist())  # the one host sync

    def _terms(self, name: str) -> torch.Tensor:
        """Each step's value × size, in float64, on the device."""
        values = [v if isinstance(v, torch.Tensor) else torch.tensor(v) for v in self.values[name]]
        if len({(v.dtype, v.device, v.shape) for v in values}) == 1:  # one conversion for them all
            stacked = torch.stack(values).reshape(len(values)).to(self.device, torch.float64)
        else:
            stacked = torch.stack([v.reshape(()).to(self.device, torch.float64) for v in values])
        return stacked * torch.tensor(self.sizes[name], dtype=torch.float64, device=self.device)


def _anchors(
    model: nn.Module, global_weights: Mapping[str, torch.Tensor], device: torch.device, names: set[str]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, its global value) pairs for the proximal term, of the parameters `names`."""
    params = dict(model.named_parameters())
    return [(p, global_weights[name].to(device)) for name, p in params.items()
            if name in global_weights and name in names]
