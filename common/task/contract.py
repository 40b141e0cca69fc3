"""The Task contract: what a user writes to bring any PyTorch workload to fedmq.

A Task is one class. fedmq builds it from the job spec (``task: "pkg.module:Name"`` and its
``options``) in every process that needs it, and calls its methods there:

    aggregator   build_model, load_server_data, evaluate      (never load_data)
    learner      build_model, load_data (only the clients it serves), train or loss, evaluate
    CLI          check_job (optional), before the job is run or submitted

    class Regression(fedmq.Task):
        def build_model(self) -> nn.Module: ...                     # no data needed
        def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData: ...
        def loss(self, model, batch) -> Tensor: ...                 # fedmq runs the loop, or
        def train(self, model, data, ctx) -> fedmq.TrainResult: ... # any code of yours
        def evaluate(self, model, data, ctx) -> dict[str, float]: ...

Two levels of control. A Task that defines `loss` lets fedmq run local training (the spec's
`train` section: epochs, batch size, optimizer); that is what lets fedmq train a round's
clients together, clip per sample and compress without a change to the Task. A Task that
defines `train` runs any code it likes on the model it is handed. Defining `evaluate` is
optional for a loss-level Task: by default it is the mean of `loss` and the metrics `loss`
returns, over the data in order.

Rules that keep runs reproducible and safe:
- Every method may be called in any process, any number of times, in any order of clients:
  derive randomness from the context (`ctx.seed`, `ctx.generator`, `ctx.rng(...)`), never from
  global state. fedmq seeds torch's global RNG around each call (model init, dropout).
- `build_model` must give the same architecture every time; fedmq seeds its initial weights.
- `train` trains the model it is given in place and must not replace its parameters; it must
  leave them finite (NaN or infinity fails the job, naming the client and round).
- fedmq puts the model in training mode (`model.train()`) before `train` or the loop over
  `loss`, and in evaluation mode (`model.eval()`) before `evaluate`.
- A learner keeps what `load_data` returns and reuses it in later rounds (a bounded cache):
  keep no random state in it (a DataLoader's own generator); shuffle with `ctx.generator`.
- Metrics are plain floats with names matching ``[A-Za-z_][A-Za-z0-9_.]*``.
- `loss` is a function of the model's weights and the batch: trained together, a round's clients
  take steps that fedmq records once and replays (common/task/traced.py). A number the loss reads
  from the Task's own attributes (`self.scale`) is part of what a recording is kept for; anything
  deeper that changes between calls (an attribute of an attribute) is not seen, so keep it fixed
  or read it from the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from fedmq.common.task.contexts import (
    ClientData,
    DataContext,
    DpSgd,
    EvalContext,
    EvalResult,
    ExportContext,
    Mode,
    Objective,
    Personal,
    Reduction,
    TrainContext,
    TrainResult,
    TrainSettings,
)

if TYPE_CHECKING:
    from pydantic import BaseModel
    from torch import nn

__all__ = [
    "Reduction",
    "Mode",
    "DataContext",
    "DpSgd",
    "Personal",
    "TrainSettings",
    "TrainContext",
    "EvalContext",
    "ExportContext",
    "ClientData",
    "TrainResult",
    "EvalResult",
    "Objective",
    "Task",
    "has_loss",
    "has_train",
]


class Task:
    """Base class of every workload; see the module docstring for the contract.

    fedmq creates a Task as ``TaskClass(**options)``. Declare ``Options`` (a pydantic model) to
    have the options validated and handed over as ``self.options``; otherwise write your own
    ``__init__`` taking the options as keyword arguments.
    """

    Options: ClassVar[type[BaseModel] | None] = None
    # How each metric combines over clients; unnamed metrics are example-weighted means.
    metric_reduction: ClassVar[Mapping[str, Reduction]] = {}
    # The default objective, when the spec names none.
    objective: ClassVar[Objective | None] = None
    # A promise about the model that lets fedmq train a large one (64 MiB of parameters or more) in
    # about 1.4x its size instead of 2.2x: in `loss`, each parameter gets one gradient per backward
    # pass (no reentrant checkpointing, no backward() of the Task's own, no in-place use of a
    # detached parameter), and nothing outside the model's state_dict keeps views of its tensors.
    # fedmq then steps each parameter as soon as its gradient is whole (a second gradient in one pass
    # fails the task, saying so) and sends the trained tensors as the update without copying them.
    lean_memory: ClassVar[bool] = False
    # True: `train` (or `loss`'s caller) keeps per-client state in ctx.state between rounds; fedmq
    # stores each client's with the aggregator (durable, checkpointed) and hands it back next time.
    keeps_state: ClassVar[bool] = False

    options: Any

    def __init__(self, **options: Any) -> None:
        if self.Options is not None:
            _refuse_unknown(self.Options, options, type(self).__name__)
            self.options = self.Options(**options)
        elif options:
            names = ", ".join(sorted(options))
            raise TypeError(f"{type(self).__name__} takes no options (got {names}); declare `Options`")

    def build_model(self) -> nn.Module:
        """An untrained model. fedmq seeds torch around this call: do not seed it yourself."""
        raise NotImplementedError(f"{type(self).__name__} must define build_model()")

    def load_data(self, ctx: DataContext) -> ClientData | Any:
        """One client's data, as `ClientData(train, val)` or just the training data."""
        raise NotImplementedError(f"{type(self).__name__} must define load_data(ctx)")

    def load_server_data(self, ctx: DataContext) -> Any | None:
        """Data the aggregator evaluates every global model on; None (the default): no server evaluation.

        `ctx.client` is -1 here: it is no client's data.
        """
        return None

    def check_job(self, ctx: DataContext) -> None:
        """Refuse a job this Task cannot run (more clients than samples): raise ValueError saying
        what to change. `fedmq run` and `fedmq submit` call it before the job starts or is
        published, with `ctx.client` -1 and no `data_dir` (it runs where the job is submitted, which
        has none of the learners' data): keep it to what is cheap and known there. Accepts
        everything by default."""
        return None

    def export(self, model: nn.Module, ctx: ExportContext) -> None:
        """After the last round, on the aggregator: write artifacts of the final model (plots,
        samples, other formats) into `ctx.out_dir`. Does nothing by default."""

    # Level 1 (`train`) and level 2 (`loss`): define one. Neither is defined here, so that
    # fedmq can tell which a Task chose (`has_train` / `has_loss`).

    def evaluate(self, model: nn.Module, data: Any, ctx: EvalContext) -> Mapping[str, float] | EvalResult:
        """Metrics of `model` on `data`. A loss-level Task inherits the mean loss and its metrics."""
        from fedmq.common.task.loop import evaluate_with_loss

        if not has_loss(self):
            raise NotImplementedError(f"{type(self).__name__} must define evaluate() (it has no loss())")
        return evaluate_with_loss(self, model, data, ctx)


def _refuse_unknown(model: Any, options: Mapping[str, Any], task: str, path: str = "") -> None:
    """ConfigError naming an option key `model` (a pydantic model) does not declare, with the key it
    was likely meant to be: a plain BaseModel would ignore it. A model with extra="allow" keeps it."""
    import difflib

    from pydantic import BaseModel

    from fedmq.common.errors import ConfigError

    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return
    if model.model_config.get("extra") == "allow":
        return  # an Options model that asks for extra keys gets them
    fields = model.model_fields
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    for key, value in options.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"task {task}: its options are invalid:\n  - task.options.{path}{key}: unknown "
                              f"key{hint}; allowed: {', '.join(fields) or 'none'}")
        field = fields.get(key)
        if field is not None and isinstance(value, Mapping):
            _refuse_unknown(field.annotation, value, task, f"{path}{key}.")


def has_loss(task: Task) -> bool:
    """Whether the Task gives a per-batch loss (level 2): fedmq runs its training loop."""
    return callable(getattr(task, "loss", None))


def has_train(task: Task) -> bool:
    """Whether the Task trains with its own code (level 1)."""
    return callable(getattr(task, "train", None))
