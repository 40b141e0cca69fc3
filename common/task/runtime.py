"""One job's Task at work in a service: every call into user code goes through here.

Each call is seeded, checked (what it returns must be what the contract says) and named when
it fails: a UserCodeError carries the Task method, the client and the round, so a job fails
with a reason a user can act on.

Seeding: torch's global RNG (dropout, `torch.rand` in user code) is seeded from (job seed,
round, client) around every call. It is one per process: building models and loading data
take turns under a lock, but training and evaluation do not (a Task hung in one learner
thread must not stop the others), so with several learner threads in one process
(`fedmq run --learners N`) only `ctx.generator` draws are reproducible. One learner per
process, the default and every deployment, reproduces both.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedmq.common.errors import ConfigError
from fedmq.common.finite import all_finite, all_finite_many
from fedmq.common.seeding import derive_seed
from fedmq.common.strategy.checks import check_tensor_map
from fedmq.common.task import personal
from fedmq.common.task.batches import source
from fedmq.common.task.contract import (
    ClientData,
    DataContext,
    EvalContext,
    EvalResult,
    ExportContext,
    Task,
    TrainContext,
    TrainResult,
    has_loss,
    has_train,
)
from fedmq.common.task.dpsgd import EPSILON
from fedmq.common.task.loop import train_with_loss
from fedmq.common.task.metrics import check_metrics, check_rules
from fedmq.common.usercode import MESSAGE_CHARS, UserCodeError, user_code

if TYPE_CHECKING:
    from fedmq.common.allowlist import AllowList
    from fedmq.common.jobspec import JobSpec

# torch's global RNG is one per process: model building and data loading take turns (module docstring).
_RNG_LOCK = threading.RLock()


@dataclass
class TaskRuntime:
    """A job's spec and its Task instance, as the aggregator and learners use them."""

    spec: JobSpec
    task: Task

    @classmethod
    def for_job(cls, spec: JobSpec, allowed: AllowList | None = None) -> TaskRuntime:
        """The job's Task, from a module `allowed` lets it import (default: the list in force)."""
        from fedmq.common.task.loading import make_task

        runtime = cls(spec, make_task(spec.task.name, spec.task.options, allowed))
        with user_code("metric_reduction"):
            check_rules(runtime.task.metric_reduction)
        return runtime

    @property
    def reductions(self) -> dict[str, str]:
        """How each training metric combines over clients: the Task's rules, and DP-SGD's ε is the
        largest (the round's guarantee is its weakest client's)."""
        rules: dict[str, str] = dict(self.task.metric_reduction)
        if self.spec.train.dp_sgd is not None:
            rules[EPSILON] = "max"
        return rules

    def build_model(self) -> nn.Module:
        """The Task's model with fedmq's seeded initial weights (the same in every process)."""
        with _RNG_LOCK, torch.random.fork_rng(devices=[]), user_code("build_model"):
            _seed(derive_seed(self.spec.seed, "init"))
            model = self.task.build_model()
            if not isinstance(model, nn.Module):
                raise TypeError(f"returned a {type(model).__name__}, expected a torch.nn.Module")
        return model

    def data_context(self, client: int, data_dir: Path | None) -> DataContext:
        site = self.spec.clients.site(client) if client >= 0 else None
        return DataContext(
            client=client, num_clients=self.spec.clients.total, seed=self.spec.seed, data_dir=data_dir,
            site=site,
        )

    def load_data(self, client: int, data_dir: Path | None) -> ClientData:
        """One client's data, as ClientData (a bare return value is its training data)."""
        with _RNG_LOCK, torch.random.fork_rng(devices=[]), user_code("load_data", client=client):
            _seed(derive_seed(self.spec.seed, "data", client))
            data = self.task.load_data(self.data_context(client, data_dir))
            data = data if isinstance(data, ClientData) else ClientData(train=data)
            loop = has_loss(self.task) and not has_train(self.task)  # fedmq's loop batches the data
            if loop and data.train is not None:
                source(data.train, "the training data load_data returned")
        return data

    def export(self, model: nn.Module, out_dir: Path, server_round: int) -> None:
        """The Task's artifacts of the final model, written into `out_dir`."""
        out_dir.mkdir(parents=True, exist_ok=True)
        with user_code("export", round=server_round):
            self.task.export(model, ExportContext(out_dir=out_dir, round=server_round, seed=self.spec.seed))

    def load_server_data(self, data_dir: Path | None) -> Any:
        with user_code("load_server_data"):
            return self.task.load_server_data(self.data_context(-1, data_dir))

    def train(self, model: nn.Module, data: ClientData, ctx: TrainContext) -> TrainResult:
        """Train `model` in place on one client, with the Task's own `train` or fedmq's loop."""
        return self.trained(model, data, ctx)[1]

    def trained(
        self, model: nn.Module, data: ClientData, ctx: TrainContext
    ) -> tuple[dict[str, torch.Tensor], TrainResult]:
        """`train`, with the trained model's state_dict (its own tensors), found finite and of the
        names, shapes and dtypes it had before."""
        before = _shapes(model.state_dict(keep_vars=True))  # no detached copies: only looked at
        method = "train" if has_train(self.task) else "loss"
        if method == "train" and ctx.train.dp_sgd is not None:  # the CLI refuses it before publishing
            raise ConfigError(
                "train.dp_sgd is fedmq's loop's: a Task with its own train() trains as it likes; "
                "define loss() instead of train(), or remove train.dp_sgd from the spec"
            )
        if method == "train" and ctx.train.personal is not None:
            raise ConfigError(
                "personalize is fedmq's loop's: a Task with its own train() keeps what it likes in "
                "ctx.state; define loss() instead of train(), or remove personalize from the spec"
            )
        with (
            torch.random.fork_rng(devices=_cuda(ctx.device)),
            user_code(method, client=ctx.client, round=ctx.round),
        ):
            _seed(derive_seed(self.spec.seed, "torch", ctx.round, ctx.client), ctx.device)
            if method == "train":
                model.train()  # whatever mode the last call left it in: the same in every process
                result = self.task.train(model, data.train, ctx)  # type: ignore[attr-defined]
            elif has_loss(self.task):
                personal.before_training(model, ctx)
                result = train_with_loss(self.task, model, data.train, ctx)  # sets train mode itself
                personal.after_training(self.task, model, data.train, ctx)
            else:
                raise TypeError("the Task defines neither train() nor loss(); define one")
            if not isinstance(result, TrainResult):
                raise TypeError(f"returned a {type(result).__name__}, expected fedmq.TrainResult")
            metrics = check_metrics(result.metrics, "training metrics")
            if not isinstance(result.num_examples, int) or result.num_examples < 0:
                raise TypeError(f"num_examples must be a non-negative int, got {result.num_examples!r}")
            state = model.state_dict()
            if _shapes(state) != before:
                raise TypeError("the model's tensors changed names, shapes or dtypes during training")
            if bad := _non_finite(state):
                raise _diverged(bad)
            extras = check_tensor_map(result.extras, "TrainResult.extras")
        # Copies, never views of the model or the Task's own state: the update travels after the
        # next client trains (the in-memory bus reads an owned update's parts on its consumer's thread).
        private = {k: v.detach().to("cpu", copy=True) for k, v in extras.items()}
        return state, TrainResult(result.num_examples, metrics, private)

    def train_group(
        self, model: nn.Module, datas: list[ClientData], ctxs: list[TrainContext]
    ) -> list[tuple[dict[str, torch.Tensor], TrainResult] | UserCodeError] | None:
        """Train several clients from `model`'s weights together (fused.py); None: train them one
        at a time with `train` (a Task with its own `train`, a model or loss fusion cannot take,
        or an error in the loss, which the sequential call then names for its client).

        Each client's weights (on the CPU, in state_dict order) and checked result, or the
        UserCodeError that fails that client alone (its training diverged)."""
        from fedmq.common.task.fused import train_fused

        if has_train(self.task) or not has_loss(self.task):
            return None
        streams = [ctx.generator.get_state() for ctx in ctxs]
        first = ctxs[0]
        try:
            with (
                torch.random.fork_rng(devices=_cuda(first.device)),
                user_code("loss", client=first.client, round=first.round),
            ):
                _seed(derive_seed(self.spec.seed, "torch", first.round, first.client), first.device)
                fused = train_fused(self.task, model, [data.train for data in datas], ctxs)
        except UserCodeError:
            fused = None
        if fused is None:
            for ctx, state in zip(ctxs, streams, strict=True):
                ctx.generator.set_state(state)
            return None
        names = list(model.state_dict())
        out: list[tuple[dict[str, torch.Tensor], TrainResult] | UserCodeError] = []
        for ctx, one in zip(ctxs, fused, strict=True):
            if (err := one.error) is not None:  # as the sequential loop would have failed it
                name, message = type(err).__name__, str(err)[:MESSAGE_CHARS]
                out.append(UserCodeError("loss", name, message, round=ctx.round, client=ctx.client))
                continue
            weights = {n: one.weights[n].to("cpu") for n in names}
            try:
                with user_code("loss", client=ctx.client, round=ctx.round):
                    metrics = check_metrics(one.result.metrics, "training metrics")
                    if not one.finite and (bad := _non_finite(weights)):
                        raise _diverged(bad)
                out.append((weights, TrainResult(one.result.num_examples, metrics)))
            except UserCodeError as exc:
                out.append(exc)
        return out

    def evaluate(self, model: nn.Module, data: Any, ctx: EvalContext) -> EvalResult:
        """Metrics of `model` on `data`, checked; the example count is len(data) unless given."""
        if getattr(type(self.task), "evaluate", None) is not Task.evaluate:  # fedmq's own sets the mode
            model.eval()  # as for training: the mode never depends on which call came before
        with (
            torch.random.fork_rng(devices=_cuda(ctx.device)),
            user_code("evaluate", client=ctx.client, round=ctx.round),
        ):
            _seed(derive_seed(self.spec.seed, "eval", ctx.round, -1 if ctx.client is None else ctx.client),
                  ctx.device)
            out = self.task.evaluate(model, data, ctx)
            if isinstance(out, EvalResult):
                count, raw = out.num_examples, out.metrics
            elif isinstance(out, Mapping):
                count, raw = _length(data), out
            else:
                raise TypeError(
                    f"returned a {type(out).__name__}, expected a dict of metrics or fedmq.EvalResult"
                )
            metrics = check_metrics(raw, "evaluation metrics")
        return EvalResult(count, metrics)


def _shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def _non_finite(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of a model's floating-point tensors holding NaN or infinity (one host sync)."""
    floats = [(k, v) for k, v in state.items() if v.is_floating_point() and v.numel()]
    if not floats or all_finite_many([v for _, v in floats]):
        return []
    finite = torch.stack([all_finite(v) for _, v in floats]).cpu().tolist()
    return [name for (name, _), ok in zip(floats, finite, strict=True) if not ok]


def _diverged(names: list[str]) -> FloatingPointError:
    return FloatingPointError(
        f"training left NaN or infinite values in {', '.join(names[:5])}: the model diverged "
        "(a lower learning rate, gradient clipping or a check of the data may help)"
    )


def _seed(seed: int, device: torch.device | None = None) -> None:
    """Seed the CPU generator and `device`'s (every started GPU's without one), as torch.manual_seed
    would. Not torch.manual_seed itself: with CUDA built in but not started, each call records the
    caller's stack for a lazy CUDA seeding (measured: a fifth of a one-step client's training)."""
    torch.random.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        with torch.cuda.device(device.index or 0):
            torch.cuda.manual_seed(seed)
    elif device is None and torch.cuda.is_initialized():  # building or loading may draw on any GPU
        torch.cuda.manual_seed_all(seed)


def _cuda(device: torch.device) -> list[int]:
    """The CUDA devices whose RNG a seeded section forks: the one it runs on, if any."""
    return [device.index or 0] if device.type == "cuda" else []


def _length(data: Any) -> int:
    from fedmq.common.task.batches import source

    try:
        size = source(data, "evaluation data").size
    except TypeError:
        size = None
    return size if size is not None else 1
