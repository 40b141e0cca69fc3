"""Training a round's clients together: one batched step for every client with a next batch.

    rows[name]   (G, *shape)       one row per client, each starting from the round's global weights;
                                   buffers too (BatchNorm's running statistics), updated in place
                                   by the forward, each client its own row (batchnorm.py)
    step t       every client with a t-th batch (its own order, drawn exactly as the sequential
                 loop draws it) takes its step in one call:
                   loss averages its examples   batches padded (`_length`: on a CPU the next power
                   (and no buffers)             of two, on a GPU the batch size), per-example losses
                                                (a vmap one level down) masked to the real ones
                   otherwise                    clients grouped by exact batch size, the loss as written
                 vmap(grad(loss))(rows[group], batches[group]); which of the two is decided on the
                 first batch, by comparing the loss of a batch with the mean of its examples' losses
                 train.dp_sgd: every example's gradient (vmap(grad) one level down), clipped, summed
                 and noised from each client's own stream, as dpsgd.py does for one client
                 replayed: a step's gradients (and DP-SGD's) are recorded as the aten operations
                 they ran once their layout recurs, and those run from then on (traced.py): the
                 same bits, about half the time of a small model's step
    update       the optimizer's arithmetic on the group's rows: SGD (momentum, weight decay),
                 Adam, the FedProx proximal gradient mu·(w − w_global)
    plan         with the group's data in one bank (bank.py), the steps' clients, rows and masks are
                 worked out on the host for many steps at once (up to PLAN_ROWS bank rows: a round,
                 unless its data is large) and sent to the device in three copies: on a GPU no
                 step waits for a copy (tests/unit/test_fused.py counts the waits)

Fused and sequential training agree within float tolerance, not bit for bit: batched matrix
products, masked means and the optimizer's updates reduce in another order (tests/unit/test_fused.py
bounds the difference at 1e-5). A client's fused arithmetic does not depend on which clients share
its group: a padded batch's length follows from its own size, every other batch has its own shape,
and a batched product computes each client's slice alone (BatchNorm's kernel did not: batchnorm.py).
So on CPU a fused run is bit-identical however its clients are grouped (alone, or with others on
other learners; the tests check it). On a GPU the batched kernels cuBLAS picks may depend on the
group's size: the last bits may differ there.

`train_fused` answers None when it cannot fuse, and the caller trains one client at a time as
before: data that is not indexable (a DataLoader), a loss that draws random numbers (dropout),
metrics that are not tensors or floats, SCAFFOLD's controls, or on a CPU a model over
FUSE_CPU_MAX_BYTES (slower fused there). `max_steps` ends each client's stream of batches after
that many, as it ends the sequential loop: its metrics and example count are then those of the
epoch it stopped in, as the loop's are.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedmq.common.finite import finite_by_row
from fedmq.common.strategy.contract import PROXIMAL_MU, SCAFFOLD
from fedmq.common.task.bank import Bank
from fedmq.common.task.batches import Source, batch_size_of, cut, source, to_device
from fedmq.common.task.batchnorm import BatchOfOne, rows_batch_norm, unbatched_buffers
from fedmq.common.task.contract import TrainContext, TrainResult, TrainSettings
from fedmq.common.task.dpsgd import draw_noise, epsilon_spent, noise_generator, private_gradient, refuse_model
from fedmq.common.task.functional import LossCall, loss_with_aux, unsqueeze
from fedmq.common.task.optimizers import ADAM_BETAS, ADAM_EPS
from fedmq.common.task.traced import numbers_of, replayed

if TYPE_CHECKING:
    from fedmq.common.task.contract import Task

__all__ = ["Fused", "can_fuse", "group_size", "train_fused"]



@dataclass(frozen=True)
class Fused:
    """One client's outcome: its trained weights (detached, on the contexts' device) and its result."""

    weights: dict[str, torch.Tensor]
    result: TrainResult
    finite: bool = False  # True: every value of `weights` was seen finite (False: not known)
    error: Exception | None = None  # this client failed as it would alone (its weights are empty)


# On a CPU, fused steps gain only where a step is mostly Python (a small model): a vmapped linear
# layer's weight gradient comes out transposed, and each step's update then reads it across the grain.
# `fedmq run` of digits, 10 clients a round, one epoch, fused against one at a time on 2 cores: a
# 37 KiB MLP 0.59x, 75 KiB 0.88x, 150 KiB 1.08x, 300 KiB 1.55x, 1.2 MiB 1.57x.
FUSE_CPU_MAX_BYTES = 128 * 1024


def can_fuse(model: nn.Module, ctx: TrainContext) -> str | None:
    """Why this client's training cannot be fused (None: it can), from what is known before data."""
    if ctx.device.type == "cpu" and (size := _parameter_bytes(model)) > FUSE_CPU_MAX_BYTES:
        return (f"a model of {size / 1024:,.0f} KiB trains faster one client at a time on a CPU "
                f"(fused: models of at most {FUSE_CPU_MAX_BYTES // 1024} KiB)")
    if SCAFFOLD in ctx.config:
        return "SCAFFOLD's controls are not fused"
    if ctx.train.optimizer not in ("sgd", "adam"):
        return f"optimizer {ctx.train.optimizer!r} is not fused"
    if any(not p.requires_grad for p in model.parameters()):
        return "the model has frozen parameters, which only the sequential loop leaves alone"
    if (where := unbatched_buffers(model)) is not None:
        return f"{where} keeps buffers only the sequential loop updates per client"
    return None


def _parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def group_size(model: nn.Module, settings: TrainSettings, budget_bytes: int) -> int:
    """How many clients fit a memory budget: per client, the weights, their gradients and the
    optimizer's state (one tensor for SGD with momentum, two for Adam; with DP-SGD a gradient per
    example of a batch, and the noise). At least 1."""
    weights = _parameter_bytes(model)
    states = 2 if settings.optimizer == "adam" else 1 if settings.momentum else 0
    if settings.dp_sgd is not None:  # a gradient per example, and the step's noise
        states += settings.batch_size + 1
    per_client = weights * (2 + states)
    return max(1, budget_bytes // max(1, per_client))


def train_fused(
    task: Task, model: nn.Module, datas: Sequence[Any], ctxs: Sequence[TrainContext]
) -> list[Fused] | None:
    """Train each client (`datas[i]`, `ctxs[i]`) from `model`'s weights, all at once; None: cannot fuse.
    A client that fails alone (a batch of one in BatchNorm) has its `error`; the others trained.

    Every context must share one round and one `train` section; `model` is not changed.
    """
    if not ctxs:
        return None
    settings = ctxs[0].train
    if any(ctx.train != settings or ctx.config != ctxs[0].config for ctx in ctxs):
        return None
    if can_fuse(model, ctxs[0]):  # what it asks of a context is its train section, config and device: one
        return None
    sources = [source(data, "training data") for data in datas]
    if not all(src.indexable for src in sources):
        return None
    device = ctxs[0].device
    if any(ctx.device != device or ctx.global_weights is not ctxs[0].global_weights for ctx in ctxs):
        return None
    streams = [ctx.generator.get_state() for ctx in ctxs]  # a fallback draws the same batches again
    mode = model.training
    try:
        with rows_batch_norm(model):
            return _Trainer(task, model, sources, ctxs, device).run()
    except _CannotFuse:
        for ctx, state in zip(ctxs, streams, strict=True):
            ctx.generator.set_state(state)
        return None
    finally:
        model.train(mode)


# Each Task's answer to "does its loss average its examples?", asked on its first fused batch and
# kept while the Task lives (a learner or the engine keeps one per job): asked again every round,
# its two gradients took a quarter of a fused one-step round of 10 digits clients.
_AVERAGES: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

PLAN_ROWS = 1 << 18  # bank rows planned at once: 2 MiB of int64 indices, ~8k batches' slices on the host
_Item = tuple[int, Any, bool]  # a client's batch in a step: (client, batch or index slice, starts an epoch)


@dataclass(frozen=True)
class _Prepared:
    """A group's step on the device: its clients' rows, the clients starting an epoch, each batch's
    example count (float64, for the metric sums), and with a bank the flattened (G × length) bank
    rows of its batches and their float mask of real examples."""

    index: torch.Tensor
    fresh: torch.Tensor | None
    weights: torch.Tensor
    sizes: list[int]
    length: int
    rows: torch.Tensor | None
    mask: torch.Tensor | None


class _CannotFuse(Exception):
    """The loss did something vmap cannot batch (random numbers, a data-dependent branch)."""


class _Trainer:
    def __init__(
        self, task: Task, model: nn.Module, sources: list[Source], ctxs: Sequence[TrainContext],
        device: torch.device,
    ) -> None:
        self.task = task
        self.call = LossCall(task, model)
        self.ctxs = ctxs
        self.settings = ctxs[0].train
        self.device = device
        self.count = len(ctxs)
        self.names = [name for name, _ in model.named_parameters()]
        # Tied parameters (one under two names): named_parameters gives the first name, state_dict
        # both; the outcome names the other one too (functional_call keeps them tied meanwhile).
        first = {id(p): name for name, p in model.named_parameters()}
        self.aliases = {name: first[id(t)] for name, t in model.state_dict(keep_vars=True).items()
                        if id(t) in first and first[id(t)] != name}
        start = {name: p.detach().to(device) for name, p in model.named_parameters()}
        self.rows = {name: w.unsqueeze(0).repeat(self.count, *([1] * w.dim())) for name, w in start.items()}
        # Buffers (BatchNorm's running statistics, its batch count) stacked like the parameters: the
        # forward under vmap updates each client's own row in place, as the sequential loop updates
        # the model's. No gradient; the optimizer leaves them alone.
        self.buffers = {name: b.detach().to(device).unsqueeze(0).repeat(self.count, *([1] * b.dim()))
                        for name, b in model.named_buffers()}
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        mu = float(ctxs[0].config.get(PROXIMAL_MU, 0.0))
        self.mu = mu
        self.anchor = (
            {n: ctxs[0].global_weights[n].to(device) for n in self.names if n in ctxs[0].global_weights}
            if mu > 0 else {}
        )
        # Tensor data: batches are index slices into one bank of the group's examples (bank.py).
        self.bank = Bank.of(sources, device)
        self.streams = [
            _stream(src, self.settings, ctx.generator, self.bank is not None)
            for src, ctx in zip(sources, ctxs, strict=True)
        ]
        self.totals: dict[str, torch.Tensor] = {}  # name -> each client's example-weighted sum, this epoch
        self.failures: dict[int, Exception] = {}  # client -> why it failed (its rows then mean nothing)
        self.seen = [0] * self.count
        # Forward under vmap, backward by autograd through it: the sum of independent clients'
        # losses has each client's gradient in its own row, without a grad transform per step.
        self.losses = torch.func.vmap(self._loss, in_dims=(0, 0), randomness="error")
        self.masked_losses = torch.func.vmap(self._masked_loss, in_dims=(0, 0, 0), randomness="error")
        self.per_example = torch.func.vmap(self._one_example, in_dims=(None, 0), randomness="error")
        # Decided on the first batch: does the loss average its examples? Never with buffers: a
        # batch's statistics would take in its padding, and its examples one at a time have none.
        self.masked: bool | None = False if self.buffers else None
        self.sizes = [src.size or 0 for src in sources]
        self.steps = [0] * self.count
        self.dp = self.settings.dp_sgd
        if self.dp is not None:  # DP-SGD: each example's gradient clipped, their sum noised (dpsgd.py)
            refuse_model(model)
            self.masked = True  # a gradient of each example alone: padding never changes it
            self.noise = [noise_generator(ctx) for ctx in ctxs]
            self.numel = sum(r[0].numel() for r in self.rows.values())
            each = torch.func.vmap(torch.func.grad(self._one_example, has_aux=True), in_dims=(None, 0),
                                   randomness="error")
            self.each_grads = each
            self.private_rows = torch.func.vmap(self._private_row, in_dims=(0, 0, 0, 0), randomness="error")

    def _loss(
        self, params: dict[str, torch.Tensor], batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return loss_with_aux(self.call, params, batch)

    def _one_example(
        self, params: dict[str, torch.Tensor], example: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one example, as a batch of one."""
        return self._loss(params, unsqueeze(example))

    def _masked_loss(
        self, params: dict[str, torch.Tensor], batch: Any, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean loss over a padded batch's real examples (mask 1), from per-example losses."""
        losses, aux = self.per_example(params, batch)
        count = mask.sum()
        means = {name: (values * mask).sum() / count for name, values in aux.items()}
        return (losses * mask).sum() / count, means

    def _private_row(
        self, params: dict[str, torch.Tensor], batch: Any, mask: torch.Tensor, noise: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One client's DP-SGD gradient of a padded batch, and its examples' mean metrics."""
        assert self.dp is not None
        grads, aux = self.each_grads(params, batch)
        count = mask.sum()
        means = {name: (values * mask).sum() / count for name, values in aux.items()}
        return private_gradient(grads, mask, noise, self.dp.clip_norm, self.settings.batch_size), means

    def _averages_examples(self, batch: Any) -> bool:
        """Whether the loss of a batch, its gradient and every metric are the means of its examples'
        (a cross-entropy, a squared error, an accuracy), so that padded batches with masks give the
        same step; else (sums, weighted or pairwise losses) clients are grouped by batch size only."""
        mask = torch.ones(batch_size_of(batch), device=self.device)
        whole_grad, (whole, whole_aux) = self._grad_and_value(self._loss, batch)
        each_grad, (each, each_aux) = self._grad_and_value(self._masked_loss, batch, mask)
        pairs = [(whole, each)] + [(whole_grad[n], each_grad[n]) for n in whole_grad]
        pairs += [(whole_aux[n], each_aux[n]) for n in whole_aux if n in each_aux]
        return set(whole_aux) == set(each_aux) and all(
            bool(torch.allclose(a, b, rtol=1e-4, atol=1e-6)) for a, b in pairs
        )

    def _grad_and_value(
        self, loss: Any, *inputs: Any
    ) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """The first client's gradient of `loss(params, *inputs)`, and its value and metrics: as
        torch.func.grad_and_value gives them (zeros for a parameter the loss does not use), by autograd
        itself. torch.func's grad imports torch._dynamo on its first call (1.7-2.2 s here), which a
        process would pay before its first fused step (DP-SGD's per-example gradients still do)."""
        with torch.enable_grad():
            params = {n: r[0].detach().requires_grad_(True) for n, r in self.rows.items()}
            value, aux = loss(params, *inputs)
            found = torch.autograd.grad(value, list(params.values()), allow_unused=True)
        grads = {n: torch.zeros_like(p) if g is None else g
                 for (n, p), g in zip(params.items(), found, strict=True)}
        return grads, (value.detach(), {n: a.detach() for n, a in aux.items()})

    def run(self) -> list[Fused]:
        self.call.model.train()
        for window in self._windows():
            work = [(step, group) for step, pending in window for group in self._split(pending)]
            for (step, group), prepared in zip(work, self._prepare([g for _, g in work]), strict=True):
                self._step(group, step, prepared)
        names = list(self.totals)
        totals = torch.stack([self.totals[n] for n in names]).cpu().tolist() if names else []  # one host sync
        per_client = [{n: t[i] for n, t in zip(names, totals, strict=True)} for i in range(self.count)]
        finite = self._finite()
        return [Fused({}, TrainResult(0), error=self.failures[i]) if i in self.failures
                else self._outcome(i, sums, finite[i]) for i, sums in enumerate(per_client)]

    def _finite(self) -> list[bool]:
        """Whether each client's weights are all finite: one check of the stacked rows, not one per
        client and tensor (a diverged client is then named by the runtime's own check)."""
        rows = [r.reshape(self.count, -1) for r in (*self.rows.values(), *self.buffers.values())
                if r.is_floating_point() and r.numel()]
        if not rows:
            return [True] * self.count
        # A finite sum of a client's row says its values are (NaN and ±inf carry into it); a sum that
        # is not is looked at value by value. A quarter of the cost of isfinite over every value.
        # Summed in the rows' own dtype (float32 at least): a float64 sum of float32 rows converts them
        # all first, a copy as large as the group's weights. A sum that overflows only looks again.
        sums = torch.stack([r.sum(1, dtype=torch.float32 if r.element_size() < 4 else None).isfinite()
                            for r in rows]).all(0)
        if not bool(sums.all()):
            sums = torch.stack([finite_by_row(r) for r in rows]).all(0)
        return [bool(ok) for ok in sums.tolist()]

    def _steps(self) -> Iterator[list[_Item]]:
        """Each step's batches: every client's next one, while any client has one."""
        while True:
            pending = [(i, *item) for i, stream in enumerate(self.streams) if (item := next(stream, None))]
            if not pending:
                return
            yield pending

    def _windows(self) -> Iterator[list[tuple[int, list[_Item]]]]:
        """The round's steps, numbered, in windows planned and sent to the device together: with a
        bank, steps of up to PLAN_ROWS bank rows in all (index slices: small); otherwise one step
        (its batches are the data itself)."""
        window: list[tuple[int, list[_Item]]] = []
        rows = 0
        for step, pending in enumerate(self._steps(), 1):
            if self.masked is None:
                self.masked = _remembered(self.task)
                if self.masked is None:
                    self.masked = self._decide(pending)
                    _remember(self.task, self.masked)
            window.append((step, pending))
            rows += self.settings.batch_size * len(pending)  # no batch is longer
            if self.bank is None or rows >= PLAN_ROWS:
                yield window
                window, rows = [], 0
        if window:
            yield window

    def _decide(self, pending: list[_Item]) -> bool:
        """Whether the loss averages its examples, from the first step's largest batch (of two or more)."""
        i, largest, _ = max(pending, key=lambda item: batch_size_of(item[1]))
        largest = self._batch(i, largest)
        largest = _pad(largest, max(2, batch_size_of(largest)))
        try:
            return self._averages_examples(to_device(largest, self.device))
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            raise _CannotFuse(str(err)) from err

    def _split(self, pending: list[_Item]) -> list[list[_Item]]:
        """A step's batches in the groups that step together, each in client order: with a loss that
        averages its examples, every batch of one example shape (padded to one length); otherwise
        batches of one exact shape."""
        groups: dict[Any, list[_Item]] = {}
        for item in pending:
            size = item[1].shape[0] if self.bank is not None else batch_size_of(item[1])
            key: Any = self._length(size) if self.masked else size
            if self.bank is None:
                key = (key, _signature(item[1], per_example=bool(self.masked)))
            groups.setdefault(key, []).append(item)
        return [sorted(group, key=lambda item: item[0]) for group in groups.values()]

    def _length(self, size: int) -> int:
        """The length a batch of `size` examples is padded to, from its own size alone, so that a
        client's arithmetic never depends on its company: on a GPU the job's batch size (one group a
        step, whatever the sizes); on a CPU the next power of two up to it, which halves the work of
        small clients' padded steps (14 examples: 16 rows, not 32) for a few groups more a step."""
        batch = self.settings.batch_size
        if self.device.type == "cuda" or size >= batch:
            return max(batch, size)
        return min(batch, 1 << max(0, size - 1).bit_length())

    def _prepare(self, groups: list[list[_Item]]) -> list[_Prepared]:
        """What each group's step needs on the device, sent in one copy per dtype: with a bank, the
        whole plan's in three copies, and none in its steps (a plain copy from the host to a GPU
        waits for all the work queued there: several a step would keep the GPU idle between them)."""
        if not groups:
            return []
        clients: list[int] = []
        fresh: list[int] = []  # the clients starting an epoch: the result reports the last epoch only
        sizes: list[int] = []
        shapes = []
        for group in groups:
            size = [batch_size_of(item) if self.bank is None else item.shape[0] for _, item, _ in group]
            epoch = [i for i, _, new_epoch in group if new_epoch]
            shapes.append((len(group), len(epoch), self._length(size[0]) if self.masked else size[0], size))
            clients += [i for i, _, _ in group]
            fresh += epoch
            sizes += size
        longs = [torch.tensor(clients + fresh, dtype=torch.int64)]
        floats: torch.Tensor | None = None
        if self.bank is not None:
            lengths = [length for count, _, length, _ in shapes for _ in range(count)]
            batches = [item for group in groups for _, item, _ in group]
            rows_at, real = self.bank.index(clients, batches, lengths)
            longs.append(rows_at)
            floats = real.to(torch.float32) if self.masked else None
        longs_at = self._send(torch.cat(longs))
        doubles_at = self._send(torch.tensor(sizes, dtype=torch.float64))
        floats_at = self._send(floats) if floats is not None else None
        # Where each group's part of each copy starts: clients, then fresh, then the bank's rows.
        at = {"client": 0, "fresh": len(clients), "row": len(clients) + len(fresh), "size": 0, "mask": 0}

        def take(kind: str, source: torch.Tensor, count: int) -> torch.Tensor:
            start = at[kind]
            at[kind] += count
            return source[start : start + count]

        out = []
        for count, starting, length, group_sizes in shapes:
            index = take("client", longs_at, count)
            at_fresh = take("fresh", longs_at, starting) if starting else None
            weights = take("size", doubles_at, count)
            rows = take("row", longs_at, count * length) if self.bank is not None else None
            mask = (take("mask", floats_at, count * length).reshape(count, length)
                    if floats_at is not None else None)
            out.append(_Prepared(index, at_fresh, weights, group_sizes, length, rows, mask))
        return out

    def _send(self, host: torch.Tensor) -> torch.Tensor:
        """`host` on the device; to a GPU from pinned memory, without waiting for its queued work."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _step(self, group: list[_Item], step: int, prepared: _Prepared) -> None:
        """One optimizer step for `group`. Padded (a loss that averages its examples): each batch is
        padded to `_length` of its size with copies of its first example, masked out of the loss.
        That length whichever clients share the step: a client's arithmetic is then the same in any
        group (on CPU)."""
        index = prepared.index
        whole = len(group) == self.count
        params = {n: (r if whole else r.index_select(0, index)) for n, r in self.rows.items()}
        buffers = {n: (b if whole else b.index_select(0, index)) for n, b in self.buffers.items()}
        batches, mask = self._batches(group, prepared)
        try:
            if self.dp is not None:
                grads, aux = self._private(params, group, batches, mask)
            elif len(group) == 1:
                grads, aux = self._gradients_alone(params, batches, mask, buffers)
            else:
                grads, aux = self._gradients(params, batches, mask, buffers)
        except BatchOfOne as err:  # each of the step's clients fails as it would alone; the rest go on
            for i, _, _ in group:
                self.failures.setdefault(i, err)
            return
        except (RuntimeError, ValueError, IndexError, TypeError) as err:  # random numbers, no vmap rule
            raise _CannotFuse(str(err)) from err
        if not whole:  # the forward updated the group's copies of its buffers
            for n, b in buffers.items():
                self.buffers[n].index_copy_(0, index, b)
        new = self._update(params, grads, index, whole, step)
        for n in self.names:
            if whole:
                self.rows[n] = new[n]
            else:
                self.rows[n].index_copy_(0, index, new[n])
        if prepared.fresh is not None:
            for total in self.totals.values():
                total.index_fill_(0, prepared.fresh, 0.0)
        for name, values in aux.items():  # as the sequential loop sums: value × size, in float64
            if name not in self.totals:
                self.totals[name] = torch.zeros(self.count, dtype=torch.float64, device=self.device)
            total = self.totals[name]
            total.index_add_(0, index, values.detach().to(torch.float64).reshape(-1) * prepared.weights)
        for (i, _, new_epoch), size in zip(group, prepared.sizes, strict=True):
            self.seen[i] = size if new_epoch else self.seen[i] + size
            self.steps[i] += 1

    def _gradients(
        self, rows: dict[str, torch.Tensor], batches: Any, mask: torch.Tensor | None,
        buffers: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Each client's gradient of its batch's loss, by autograd through the vmapped forward (which
        updates `buffers`, the group's rows of them, in place), replayed once its layout has been
        seen (traced.py)."""
        what = ("gradients", numbers_of(self.task))  # what the loss may read besides its inputs
        found, aux = replayed(self.call.model, what, self._autograd, rows, batches, mask, buffers)
        return dict(zip(rows, found, strict=True)), aux

    def _autograd(
        self, rows: dict[str, torch.Tensor], batches: Any, mask: torch.Tensor | None,
        buffers: dict[str, torch.Tensor],
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        with torch.enable_grad():
            params = {n: row.detach().requires_grad_(True) for n, row in rows.items()}
            if mask is not None:  # never with buffers (`masked`)
                losses, aux = self.masked_losses(params, batches, mask)
            else:
                losses, aux = self.losses(params | buffers, batches)
            found = torch.autograd.grad(losses.sum(), list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(params[n]) if g is None else g  # unused by the loss: no gradient
                 for n, g in zip(params, found, strict=True)]
        return grads, aux

    def _gradients_alone(
        self, leaves: dict[str, torch.Tensor], batches: Any, mask: torch.Tensor | None,
        buffers: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One client's step, computed as a group of two (itself twice), row 0 kept: a batched
        product over one matrix takes another kernel than over several (measured: the last bits of
        a small regressor's weights moved), and a client's bits must not depend on its company."""
        twice = {n: _twice(leaf) for n, leaf in leaves.items()}
        doubled = {n: _twice(b) for n, b in buffers.items()}
        grads, aux = self._gradients(twice, _twice(batches), None if mask is None else _twice(mask), doubled)
        for n, b in buffers.items():
            b.copy_(doubled[n][:1])
        return {n: g[:1] for n, g in grads.items()}, {n: a[:1] for n, a in aux.items()}

    def _private(
        self, params: dict[str, torch.Tensor], group: list[_Item], batches: Any, mask: torch.Tensor | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Each client's DP-SGD gradient, its noise drawn from its own stream as the sequential loop does
        (one client alone as a group of two, as `_gradients_alone` says why)."""
        assert self.dp is not None and mask is not None
        dtype = next(iter(params.values())).dtype
        noise = torch.stack([
            draw_noise(self.noise[i], self.numel, self.dp, self.device, dtype) for i, _, _ in group
        ])
        rows = {n: p.detach() for n, p in params.items()}
        what = ("dp-sgd", self.dp.clip_norm, self.settings.batch_size, numbers_of(self.task))
        if len(group) > 1:
            return replayed(self.call.model, what, self.private_rows, rows, batches, mask.to(dtype), noise)
        grads, aux = replayed(self.call.model, what, self.private_rows, _twice(rows), _twice(batches),
                              _twice(mask.to(dtype)), _twice(noise))
        return {n: g[:1] for n, g in grads.items()}, {n: a[:1] for n, a in aux.items()}

    def _batch(self, client: int, item: Any) -> Any:
        """A client's batch: `item` itself, or with a bank the examples its index slice names."""
        return item if self.bank is None else self.bank.batch(client, item)

    def _batches(self, group: list[_Item], prepared: _Prepared) -> tuple[Any, torch.Tensor | None]:
        """The group's batches stacked on the client axis, and with a padded step their (G, length)
        mask: from the bank by the prepared rows, else each batch padded (copies of its first
        example) and stacked."""
        if self.bank is not None:
            assert prepared.rows is not None
            batches = self.bank.take(prepared.rows, len(group), prepared.length)
            return batches, prepared.mask  # None unless masked
        if not self.masked:
            return _stack([batch for _, batch, _ in group], self.device), None
        batches = _stack([_pad(batch, prepared.length) for _, batch, _ in group], self.device)
        real = [(torch.arange(prepared.length) < size).to(torch.float32) for size in prepared.sizes]
        return batches, self._send(torch.stack(real))

    def _update(
        self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], index: torch.Tensor,
        whole: bool, step: int,
    ) -> dict[str, torch.Tensor]:
        """One optimizer step for the group's rows, as torch.optim's single-tensor SGD and Adam do it."""
        s = self.settings
        out = {}
        steps = {}  # SGD: each parameter's step, taken for all of them in one call
        for n in self.names:
            p, g = params[n], grads[n]
            if self.mu > 0 and n in self.anchor:
                g = g.add(p - self.anchor[n], alpha=self.mu)
            if s.weight_decay:
                g = g.add(p, alpha=s.weight_decay)
            if s.optimizer == "adam":
                out[n] = self._adam(n, p, g, index, whole, step)
                continue
            if s.momentum:
                g = self._state(n, "momentum", g, index, whole, first=step == 1)
            steps[n] = g
        if steps:  # p - lr·g in place, as the loop's p.add_(g, alpha=-lr): `params` are the group's own
            # (its rows, or its copies of them). A new tensor a step cost a large model's update a
            # page fault per page of it: 4 clients of a 4 MiB model on a CPU, 38 ms a step against 21
            # in place (the rest is reading the transposed gradient: 3.5 ms where the strides match).
            names = list(steps)
            moved = [params[n] for n in names]
            torch._foreach_add_(moved, [steps[n] for n in names], alpha=-s.lr)
            out.update(zip(names, moved, strict=True))
        return out

    def _state(
        self, name: str, key: str, value: torch.Tensor, index: torch.Tensor, whole: bool, first: bool
    ) -> torch.Tensor:
        """SGD's momentum buffer for the group's rows: g on the first step, momentum·buf + g after."""
        slot = self.state.setdefault(name, {})
        if first:
            if key not in slot:
                slot[key] = torch.zeros_like(self.rows[name])
            new = value
        else:
            old = slot[key] if whole else slot[key].index_select(0, index)
            new = self.settings.momentum * old + value
        if whole:
            slot[key] = new
        else:
            slot[key].index_copy_(0, index, new)
        return new

    def _adam(
        self, name: str, p: torch.Tensor, g: torch.Tensor, index: torch.Tensor, whole: bool, step: int
    ) -> torch.Tensor:
        b1, b2 = ADAM_BETAS
        slot = self.state.setdefault(name, {})
        if "m" not in slot:
            slot["m"], slot["v"] = torch.zeros_like(self.rows[name]), torch.zeros_like(self.rows[name])
        m = slot["m"] if whole else slot["m"].index_select(0, index)
        v = slot["v"] if whole else slot["v"].index_select(0, index)
        m = m.lerp(g, 1 - b1)
        v = v * b2 + (1 - b2) * g * g
        if whole:
            slot["m"], slot["v"] = m, v
        else:
            slot["m"].index_copy_(0, index, m)
            slot["v"].index_copy_(0, index, v)
        correction1 = 1 - b1**step
        correction2 = math.sqrt(1 - b2**step)
        denom = v.sqrt() / correction2 + ADAM_EPS
        return p - (self.settings.lr / correction1) * (m / denom)

    def _outcome(self, i: int, totals: dict[str, float], finite: bool) -> Fused:
        # Views of the group's rows, which nothing changes once the group has trained (a copy each
        # took 0.2 ms of a 10-client round): they share its storage until the round lets them go.
        weights = {n: self.rows[n][i].detach() for n in self.names}
        weights |= {alias: weights[name] for alias, name in self.aliases.items()}
        weights |= {n: b[i] for n, b in self.buffers.items()}
        seen = self.seen[i]
        metrics = {name: total / seen for name, total in totals.items()} if seen else {}
        if self.dp is not None:
            rounds = self.ctxs[i].round
            metrics |= epsilon_spent(self.dp, self.settings.batch_size, self.sizes[i], self.steps[i], rounds)
        return Fused(weights, TrainResult(seen, metrics), finite)


def _stream(
    src: Source, settings: TrainSettings, generator: torch.Generator, indices: bool
) -> Iterator[tuple[Any, bool]]:
    """A client's batches over all its epochs, drawn as `Source.batches` draws them (with `indices`,
    each batch's index slice instead: the same draws), up to `max_steps` of them (then no epoch
    after the last batch is drawn, as the loop returns there); True for an epoch's first batch."""
    left = settings.max_steps
    for _ in range(settings.epochs):
        if left == 0:
            return
        first = True
        if indices:
            assert src.size is not None
            order = torch.randperm(src.size, generator=generator)  # as Source.batches draws and cuts it
            batches: Iterator[Any] = cut(order, settings.batch_size)
        else:
            batches = src.batches(settings.batch_size, generator)
        for batch in batches:
            yield batch, first
            first = False
            if left is not None:
                left -= 1
                if left == 0:  # before the next batch is drawn (a Dataset's items are read then)
                    return


def _signature(batch: Any, per_example: bool = False) -> tuple[int, ...] | int:
    """What must match for batches to stack: every tensor's shape (and so the batch size), or with
    `per_example` every tensor's shape past the batch dimension (what must match to pad)."""
    if isinstance(batch, torch.Tensor):
        shape = tuple(batch.shape)[1:] if per_example else tuple(batch.shape)
        return (hash((shape, batch.dtype)),)
    if isinstance(batch, tuple | list):
        return tuple(h for b in batch for h in _as_tuple(_signature(b, per_example)))
    if isinstance(batch, Mapping):
        return tuple(
            h for k in sorted(batch) for h in (hash(k), *_as_tuple(_signature(batch[k], per_example)))
        )
    raise _CannotFuse(f"a batch of type {type(batch).__name__}")


def _as_tuple(value: tuple[int, ...] | int) -> tuple[int, ...]:
    return value if isinstance(value, tuple) else (value,)


def _pad(batch: Any, size: int) -> Any:
    """A batch grown to `size` examples with copies of its first (masked out later)."""
    if isinstance(batch, torch.Tensor):
        extra = size - batch.shape[0]
        return torch.cat([batch, batch[:1].expand(extra, *batch.shape[1:])]) if extra else batch
    if isinstance(batch, tuple | list):
        return type(batch)(_pad(b, size) for b in batch)
    return {k: _pad(v, size) for k, v in batch.items()}


def _remembered(task: Any) -> bool | None:
    try:
        return _AVERAGES.get(task)
    except TypeError:  # a Task that cannot be a key (__eq__ without __hash__): asked each time
        return None


def _remember(task: Any, averages: bool) -> None:
    with contextlib.suppress(TypeError):  # as `_remembered`
        _AVERAGES[task] = averages


def _twice(value: Any) -> Any:
    """Tensors (of a batch, a tree of them) with their one row along the client axis repeated."""
    if isinstance(value, torch.Tensor):
        return torch.cat([value, value])
    if isinstance(value, tuple | list):
        return type(value)(_twice(v) for v in value)
    return {k: _twice(v) for k, v in value.items()}


def _stack(batches: list[Any], device: torch.device) -> Any:
    """Equal-shaped batches of tensors, tuples or dicts stacked on a new leading client axis."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(batches).to(device, non_blocking=True)
    if isinstance(first, tuple | list):
        return type(first)(_stack([b[k] for b in batches], device) for k in range(len(first)))
    return {k: _stack([b[k] for b in batches], device) for k in first}
