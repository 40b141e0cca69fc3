"""What a Task is handed and what it returns: the contexts, settings and results of the Task
contract (common/task/contract.py, which re-exports them as fedmq's public names).

Plain frozen dataclasses: fedmq's loop (common/task/loop.py), its optimizers and personalization
read them without importing the Task class, so the contract can default to that loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy as np
    import torch

    from fedmq.common.jobspec import PersonalizeSpec, TrainSpec

Reduction = Literal["mean", "sum", "min", "max", "geometric"]
Mode = Literal["min", "max"]


@dataclass(frozen=True)
class DataContext:
    """Whose data to load: a learner asks for one client at a time (the aggregator never does)."""

    client: int  # the logical client, 0 .. num_clients - 1
    num_clients: int
    seed: int  # the job's seed
    data_dir: Path | None = None  # this machine's FEDMQ_DATA_DIR: files that exist only here
    site: str | None = None  # the site's name when the job's clients are named sites

    def rng(self, *keys: str | int) -> np.random.Generator:
        """A NumPy generator derived from (seed, "data", *keys): the same in every process."""
        from fedmq.common.seeding import numpy_rng

        return numpy_rng(self.seed, "data", *keys)


@dataclass(frozen=True)
class DpSgd:
    """The spec's `train.dp_sgd`: per-example gradients clipped to `clip_norm`, Gaussian noise of
    std `noise_multiplier`·`clip_norm` added to their sum each step; ε reported at `delta`."""

    clip_norm: float
    noise_multiplier: float
    delta: float = 1e-5


@dataclass(frozen=True)
class Personal:
    """The spec's `personalize`: fedmq's loop keeps a model of each client's own (common/task/personal.py)."""

    method: Literal["fedper", "ditto"]
    layers: tuple[str, ...] = ()  # fedper: the client's own parameters (and buffers), by fnmatch pattern
    lam: float = 0.1  # ditto: the pull of the personal model toward the round's global one

    @classmethod
    def from_spec(cls, spec: PersonalizeSpec | None) -> Personal | None:
        return None if spec is None else cls(spec.method, tuple(spec.layers), spec.lam)


@dataclass(frozen=True)
class TrainSettings:
    """The spec's `train` section, as a Task sees it."""

    epochs: int = 1
    batch_size: int = 32
    max_steps: int | None = None
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    options: Mapping[str, Any] = field(default_factory=dict)  # free-form, for a Task's own `train`
    dp_sgd: DpSgd | None = None  # fedmq's loop trains with DP-SGD; a Task's own `train` cannot
    keep_optimizer_state: bool = False  # fedmq's loop keeps the optimizer's state in ctx.state
    personal: Personal | None = None  # the spec's personalize section (fedmq's loop)

    @classmethod
    def from_spec(cls, train: TrainSpec, personalize: PersonalizeSpec | None = None) -> TrainSettings:
        """The spec's `train` section (and `personalize`) as a Task sees it."""
        dp = train.dp_sgd
        personal = Personal.from_spec(personalize)
        return cls(
            epochs=train.epochs, batch_size=train.batch_size, max_steps=train.max_steps,
            optimizer=train.optimizer, lr=train.lr, momentum=train.momentum,
            weight_decay=train.weight_decay, options=dict(train.options),
            dp_sgd=None if dp is None else DpSgd(dp.clip_norm, dp.noise_multiplier, dp.delta),
            keep_optimizer_state=train.keep_optimizer_state, personal=personal,
        )


@dataclass(frozen=True)
class TrainContext:
    """One client's training in one round."""

    client: int
    round: int
    seed: int
    train: TrainSettings
    device: torch.device
    generator: torch.Generator  # CPU, seeded for (seed, round, client): shuffle and sample with it
    # The round's global model (read-only), e.g. for FedProx; valid during this call only. A large
    # one (over 64 MB, on RabbitMQ) is read from the learner's disk on each lookup: look each
    # tensor up once (the loop copies its anchors once a client), not every step.
    global_weights: Mapping[str, torch.Tensor]
    # What the strategy sends this round (Strategy.configure). FedProx's "proximal_mu": fedmq's loop
    # adds mu/2·||w − w_global||²; a Task's own train adds it itself from ctx.global_weights.
    # SCAFFOLD's "scaffold": fedmq's loop corrects each gradient by the controls in client_state and
    # returns their deltas as extras; a Task's own train uses fedmq.Controls.
    config: Mapping[str, Any] = field(default_factory=dict)
    # The strategy's stored tensors for this client (control variates, residuals); {} unless the
    # strategy keeps per-client state, and on the client's first round.
    client_state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # train.dp_sgd: this client's secret seed this round, from the learner's FEDMQ_DP_KEY. DP-SGD's
    # noise and, through `generator`, its batch order come from it: the server cannot recompute them.
    private_seed: int | None = None
    # This client's own state, kept between its rounds when the Task sets `keeps_state` (or the spec
    # train.keep_optimizer_state): what its last training left here, {} the first time. Change it in
    # place; tensors (kept on the CPU between rounds), ints, floats and bools (common/task/state.py).
    # fedmq's loop keeps its own here under `optimizer.`, `personal.` and `ditto.`: a Task's keys
    # start otherwise.
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalContext:
    """An evaluation of a global model: on the server (client None) or on one client's data."""

    round: int
    seed: int
    device: torch.device
    batch_size: int = 256
    client: int | None = None


@dataclass(frozen=True)
class ExportContext:
    """Where the final model's artifacts go (the aggregator's folder for the job), and its round."""

    out_dir: Path
    round: int
    seed: int


@dataclass(frozen=True)
class ClientData:
    """What `load_data` returns: a client's training data and, optionally, its validation data.

    Each may be a tuple of tensors with a common first dimension (`(x, y)`), a dict of such
    tensors, a map-style `torch.utils.data.Dataset`, or any iterable of batches (a
    `DataLoader`, used as it is: fedmq then cannot shuffle it, fuse it or count it in advance).
    """

    train: Any
    val: Any = None


@dataclass(frozen=True)
class TrainResult:
    """What a Task's own `train` returns: how many examples it trained on, metrics, and extras.

    `extras` are tensors sent to the strategy beside the weights (`ClientResult.load_extras()`):
    a control-variate delta, a compressed payload, a count.
    """

    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalResult:
    """What `evaluate` returns when the example count is not `len(data)`."""

    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Objective:
    """Which metric picks the best round: `source.name` (e.g. "server.accuracy") and its direction."""

    metric: str
    mode: Mode = "max"
