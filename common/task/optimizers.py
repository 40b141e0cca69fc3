"""The loop's optimizers: torch.optim's SGD and Adam steps as their single-tensor paths compute them,
the same bits, without torch.optim.

Why not torch.optim itself: around each step it runs hooks, profiler records and checks that on a
small model cost as much as the step (a digits client trained 1.5x slower), and building the first
torch.optim optimizer in a process imports torch's compiler stack (torch._dynamo: about 2 s here),
which `fedmq run` paid before its first round. tests/unit/test_loop_optimizers.py checks both
against torch.optim step by step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from fedmq.common.task.contexts import TrainSettings

__all__ = ["Adam", "Sgd", "make_optimizer"]

ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults
ADAM_EPS = 1e-8


def make_optimizer(params: Iterable[torch.Tensor], settings: TrainSettings) -> Sgd | Adam:
    """The optimizer the spec names, over `params` (a model's parameters, in their order)."""
    if settings.optimizer == "adam":
        return Adam(params, settings.lr, settings.weight_decay)
    return Sgd(params, settings.lr, settings.momentum, settings.weight_decay)


class _Steps:
    """What both optimizers share: their parameters, a step over each that has a gradient, zeroing
    their gradients as torch.optim does, stepping during the backward pass, and their state as
    named entries of a client's state (train.keep_optimizer_state)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        self._stepped: set[int] = set()  # in_backward: the parameters stepped since zero_grad

    def state_entries(self, names: list[str]) -> dict[str, torch.Tensor | int]:
        """This optimizer's state, "optimizer.<what>.<parameter name>" (`names`: the parameters')."""
        return {}

    def load_entries(self, state: Mapping[str, object], names: list[str]) -> None:
        """The state `state_entries` gave, back into this optimizer (what `state` lacks starts afresh)."""

    def _tensor(self, state: Mapping[str, object], key: str, i: int) -> torch.Tensor | None:
        value = state.get(key)
        if value is None:
            return None
        p = self.params[i]
        if not isinstance(value, torch.Tensor) or value.shape != p.shape:
            raise ValueError(f"the client's stored {key} does not fit its parameter of shape {list(p.shape)}")
        return value.to(p.device, p.dtype, copy=True)

    def step(self) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self._step(i, p, p.grad)

    def _step(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stepped.clear()
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @contextlib.contextmanager
    def in_backward(self) -> Iterator[None]:
        """While open, each parameter steps as soon as the backward pass has its gradient, which is
        then dropped: memory holds one layer's gradient at a time, not the whole model's again. The
        same bits as `step()` after it (each parameter's step reads only its own gradient and state),
        as long as each parameter's gradient comes once per backward pass (Task.lean_memory's promise);
        a second one raises rather than step twice. `step()` then finds no gradient. Not for what reads
        every gradient first (clipping, SCAFFOLD's correction, DP-SGD)."""

        def stepped(i: int) -> Callable[[torch.Tensor], None]:
            def hook(p: torch.Tensor) -> None:
                if p.grad is None:  # a custom backward gave it none: no step, as step() would
                    return
                if i in self._stepped:
                    raise RuntimeError(
                        f"parameter {i} of the model got a second gradient in one backward pass (reentrant "
                        "checkpointing, or a backward() of the Task's own?): stepping it during the backward "
                        "pass would step it twice. Set the Task's lean_memory = False"
                    )
                self._stepped.add(i)
                with torch.no_grad():
                    self._step(i, p, p.grad)
                p.grad = None
            return hook

        handles = [p.register_post_accumulate_grad_hook(stepped(i))
                   for i, p in enumerate(self.params) if p.requires_grad]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


class Sgd(_Steps):
    """torch.optim.SGD's single-tensor step: no dampening, no Nesterov."""

    def __init__(
        self, params: Iterable[torch.Tensor], lr: float, momentum: float, weight_decay: float
    ) -> None:
        super().__init__(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def state_entries(self, names: list[str]) -> dict[str, torch.Tensor | int]:
        pairs = zip(names, self.buffers, strict=True)
        return {f"optimizer.momentum.{n}": b for n, b in pairs if b is not None}

    def load_entries(self, state: Mapping[str, object], names: list[str]) -> None:
        self.buffers = [self._tensor(state, f"optimizer.momentum.{n}", i) for i, n in enumerate(names)]

    def step(self) -> None:
        if self.momentum or self.weight_decay:
            super().step()
            return
        with torch.no_grad():  # plain SGD: every step in one call (on a CPU, each tensor's add_ as below)
            params = [p for p in self.params if p.grad is not None]
            if params:
                torch._foreach_add_(params, [p.grad for p in params if p.grad is not None], alpha=-self.lr)

    def _step(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> None:
        if self.weight_decay != 0:
            grad = grad.add(p, alpha=self.weight_decay)
        if self.momentum != 0:
            buf = self.buffers[i]
            if buf is None:
                buf = self.buffers[i] = grad.detach().clone()
            else:
                buf.mul_(self.momentum).add_(grad, alpha=1)
            grad = buf
        p.add_(grad, alpha=-self.lr)


class Adam(_Steps):
    """torch.optim.Adam's single-tensor step with its default betas and eps: L2 weight decay, no
    AMSGrad; a parameter's step count moves only when it has a gradient."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, weight_decay: float) -> None:
        super().__init__(params)
        self.lr, self.weight_decay = lr, weight_decay
        self.moments: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.params)
        self.counts = [0] * len(self.params)

    def state_entries(self, names: list[str]) -> dict[str, torch.Tensor | int]:
        out: dict[str, torch.Tensor | int] = {}
        for n, moments, count in zip(names, self.moments, self.counts, strict=True):
            if moments is not None:
                out |= {f"optimizer.exp_avg.{n}": moments[0], f"optimizer.exp_avg_sq.{n}": moments[1],
                        f"optimizer.step.{n}": count}
        return out

    def load_entries(self, state: Mapping[str, object], names: list[str]) -> None:
        for i, n in enumerate(names):
            first = self._tensor(state, f"optimizer.exp_avg.{n}", i)
            second = self._tensor(state, f"optimizer.exp_avg_sq.{n}", i)
            count = state.get(f"optimizer.step.{n}")
            if first is not None and second is not None and isinstance(count, int):
                self.moments[i], self.counts[i] = (first, second), count

    def _step(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> None:
        beta1, beta2 = ADAM_BETAS
        moments = self.moments[i]
        if moments is None:
            moments = self.moments[i] = (
                torch.zeros_like(p, memory_format=torch.preserve_format),
                torch.zeros_like(p, memory_format=torch.preserve_format),
            )
        exp_avg, exp_avg_sq = moments
        self.counts[i] += 1
        step = float(self.counts[i])
        if self.weight_decay != 0:
            grad = grad.add(p, alpha=self.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = self.lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(ADAM_EPS)
        p.addcdiv_(exp_avg, denom, value=-step_size)
