"""Local DP-SGD for fedmq's loop: each example's gradient clipped, their sum noised (Abadi et al. 2016).

    a step on a batch of B examples (each example's loss is the Task's loss of a batch of one, so
    the loss's own reduction does not matter):
        g_i = grad loss(model, example i)              torch.func: vmap(grad), one example per row
        c_i = g_i * min(1, C / (||g_i|| + 1e-6))       the norm over every trainable parameter
        g   = (sum_i c_i + N(0, (z C)^2 I)) / B        noise from the client's secret stream; B the
                                                       job's batch size, also for a short last batch
    then the optimizer's step with g. FedProx's proximal gradient and SCAFFOLD's correction are
    added after the noise: they depend on no example.

The reported loss and metrics are the means of each example's. The noise and, for a DP-SGD job,
the client's batch order come from its secret seed (TrainContext.private_seed: the learner's
FEDMQ_DP_KEY keyed over job seed, round and client). Seeded from the job's public seed instead,
anyone holding the spec could regenerate the noise and take it out, and would know which examples
each step drew. With the same key a run is bit-reproducible on one device (CPU and GPU streams
differ), and a redelivered task draws the same noise, so training it again releases nothing new.

Privacy: each step is one sampled Gaussian mechanism with sampling rate q = B / n (n: the client's
examples), so a round of S steps composes S of them; common/privacy.py accounts for them. A client
cannot know in which earlier rounds it took part, so it reports `dp_epsilon`, the ε at the spec's δ
had it trained in every round so far (an upper bound: taking part in fewer rounds spends less),
and the round's value is the largest over that round's clients (the job's worst so far is the
largest in its history). fedmq draws each epoch's batches as a shuffle of fixed-size batches, not
Poisson sampling: ε is computed as if they were Poisson samples, the common heuristic (Abadi et
al. train the same way), not a proof for shuffled batches. Protecting one example of one client
(example-level DP) is what DP-SGD gives; the `dp_fedavg` strategy protects a whole client. ε covers
the weights a client sends; its training metrics (the loss, the Task's metrics) are computed on its
data without noise and are not covered.

What DP-SGD cannot train: BatchNorm (it mixes a batch's examples, so no example has a gradient
of its own; GroupNorm or LayerNorm can), data fedmq does not batch itself (a DataLoader: q is
unknown), and a Task with its own `train`. A loss that compares a batch's examples with each other
(contrastive, pairwise) means something else on a batch of one: DP-SGD is for per-example losses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedmq.common.errors import ConfigError
from fedmq.common.seeding import derive_seed
from fedmq.common.task.functional import LossCall, loss_with_aux, unsqueeze

if TYPE_CHECKING:
    from fedmq.common.task.contract import DpSgd, Task, TrainContext

__all__ = [
    "EPSILON", "PrivateGradients", "draw_noise", "epsilon_spent", "noise_generator", "private_gradient",
    "refuse_model",
]

EPSILON = "dp_epsilon"  # the training metric: ε spent at the spec's δ, the round's largest over clients
NORM_FLOOR = 1e-6  # added to each norm before dividing, as Opacus does: a zero gradient stays zero


def refuse_model(model: nn.Module) -> None:
    """TypeError when the model has a layer that mixes a batch's examples."""
    from torch.nn.modules.batchnorm import _BatchNorm

    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            raise TypeError(
                f"train.dp_sgd needs each example's gradient alone, and {name or 'the model'} is a "
                f"{type(module).__name__}, which mixes a batch's examples: use GroupNorm or LayerNorm"
            )


def private_gradient(
    grads: Mapping[str, torch.Tensor], mask: torch.Tensor, noise: torch.Tensor, clip_norm: float,
    batch_size: int,
) -> dict[str, torch.Tensor]:
    """Each example's gradient (rows of `grads`) clipped to `clip_norm`, summed over the examples
    `mask` keeps (1) with `noise` (flat, in `grads`' order, already scaled) added, over the job's
    batch size (as Opacus divides by the expected one: a short last batch's noise is not magnified).
    Pure tensor arithmetic: vmap runs it over a group of clients too."""
    squares = [g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values()]
    norms = torch.stack(squares).sum(0).sqrt()
    factors = (clip_norm / (norms + NORM_FLOOR)).clamp(max=1.0) * mask
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, g in grads.items():
        size = g[0].numel()
        summed = torch.tensordot(factors, g, dims=1)
        out[name] = (summed + noise[offset : offset + size].reshape(summed.shape)) / batch_size
        offset += size
    return out


def noise_generator(ctx: TrainContext) -> torch.Generator:
    """The client's noise stream for the round, on its training device, from its secret seed."""
    if ctx.private_seed is None:
        raise ConfigError(
            "train.dp_sgd needs the context's private_seed (fedmq's learner derives it from FEDMQ_DP_KEY): "
            "noise seeded from the job's public seed could be taken out by anyone holding the spec"
        )
    generator = torch.Generator(device=ctx.device)
    generator.manual_seed(derive_seed(ctx.private_seed, "dp_sgd_noise"))
    return generator


def draw_noise(
    generator: torch.Generator, numel: int, dp: DpSgd, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """One step's noise for every parameter, flat: N(0, (z C)^2) per coordinate."""
    if dp.noise_multiplier == 0:
        return torch.zeros(numel, device=device, dtype=dtype)
    noise = torch.randn(numel, generator=generator, device=device, dtype=dtype)
    return noise.mul_(dp.noise_multiplier * dp.clip_norm)


class PrivateGradients:
    """One client's DP-SGD gradients for fedmq's sequential loop: `backward` sets each trainable
    parameter's `.grad` to the step's private gradient."""

    def __init__(self, task: Task, model: nn.Module, ctx: TrainContext) -> None:
        dp = ctx.train.dp_sgd
        assert dp is not None
        refuse_model(model)
        self.dp = dp
        self.call = LossCall(task, model)
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.numel = sum(p.numel() for p in self.params.values())
        self.dtype = next(iter(self.params.values())).dtype if self.params else torch.float32
        self.device = ctx.device
        self.batch_size = ctx.train.batch_size
        self.generator = noise_generator(ctx)
        # Dropout draws a mask per example (randomness="different"), from torch's seeded stream.
        self.each = torch.func.vmap(
            torch.func.grad(self._one, has_aux=True), in_dims=(None, 0), randomness="different"
        )

    def _one(
        self, params: dict[str, torch.Tensor], example: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return loss_with_aux(self.call, params, unsqueeze(example))

    def backward(self, batch: Any) -> tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]:
        """Set the step's private gradients; the batch's mean loss and metrics over its examples."""
        params = {n: p.detach() for n, p in self.params.items()}
        grads, aux = self.each(params, batch)
        size = next(iter(grads.values())).shape[0] if grads else 0
        mask = torch.ones(size, device=self.device, dtype=self.dtype)
        noise = draw_noise(self.generator, self.numel, self.dp, self.device, self.dtype)
        private = private_gradient(grads, mask, noise, self.dp.clip_norm, self.batch_size)
        for name, p in self.params.items():
            p.grad = private[name]
        means: dict[str, torch.Tensor | float] = {name: values.mean() for name, values in aux.items()}
        loss = means.pop("loss")
        assert isinstance(loss, torch.Tensor)
        return loss, means


def epsilon_spent(dp: DpSgd, batch_size: int, examples: int, steps: int, rounds: int) -> dict[str, float]:
    """{EPSILON: ε} after `rounds` rounds of `steps` steps each; {} without noise (ε is infinite)."""
    if dp.noise_multiplier == 0 or steps == 0 or examples == 0:
        return {}
    from fedmq.common.privacy import epsilon

    rate = min(1.0, batch_size / examples)
    return {EPSILON: epsilon(dp.noise_multiplier, rate, steps * max(1, rounds), dp.delta)}
