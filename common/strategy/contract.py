"""The Strategy contract: what a user writes to decide what clients get each round and what the new model is.

A strategy decides; it never sends. The aggregator calls it, and the round loop and the bus
do the I/O:

    job created       configure(ctx for round 1)            ─▶ sent with every round-1 task
    round r closes    aggregate(ctx, current, results, failures) ─▶ Aggregate
                      configure(ctx for round r + 1)        ─▶ sent with every round r+1 task
    every commit      state()                               ─▶ saved beside the global weights
    after a restart   load_state(state)                     ─▶ resumes exactly

    class ClippedMean(fedmq.Strategy):
        class Options(fedmq.StrategyOptions):
            bound: float = 1.0

        def aggregate(self, ctx, current, results, failures):
            total = sum(r.num_examples for r in results)
            new = {k: v.clone() for k, v in current.items()}
            for r in results:
                for name, w in r.load().items():       # one client's weights, read from disk
                    step = (w - current[name]).clamp(-self.options.bound, self.options.bound)
                    new[name] += step * (r.num_examples / total)
            return fedmq.Aggregate(new, metrics={"failed": len(failures)})

A job names it as `strategy: {name: "my_pkg.strategies:ClippedMean", options: {bound: 0.5}}`.
fedmq builds it as ``Cls(Cls.Options(**options))``: an unknown or invalid option is refused
before the job is published, naming the option and the allowed ones. Options that cannot work
with the rest of the job are refused there too by the `check_job` classmethod:

        @classmethod
        def check_job(cls, options, job: fedmq.JobFacts) -> None:
            if job.min_fit < 3:
                raise ValueError(f"needs rounds of 3 clients or more; set clients.min_fit >= 3")

Client side. `configure` returns the round's config, a flat dict of numbers, strings and
booleans given to every client's training as `TrainContext.config`. fedmq's training loop
applies FedProx's proximal term when it holds ``proximal_mu``; a Task with its own `train`
applies it from `ctx.config` and `ctx.global_weights`:

    mu = ctx.config.get("proximal_mu", 0.0)
    anchors = {n: ctx.global_weights[n].to(ctx.device) for n, _ in model.named_parameters()}  # once
    ...  # then, each step:
    loss = loss + mu / 2 * sum((p - anchors[n]).pow(2).sum() for n, p in model.named_parameters())

Per-client state (control variates, error-feedback residuals) lives with the aggregator, on
disk: return it in `Aggregate.client_state`; set ``sends_client_state = True`` and the next
time a client is picked its learner receives it as `TrainContext.client_state`. A value may be
a zero-argument callable returning the map: fedmq calls it when it writes that client's state,
one client at a time in client order, so a strategy with many clients never holds all their
states together (SCAFFOLD's c_i⁺ = c_i + dc_i is one such value per client). Tensors every
client needs (SCAFFOLD's server control) go once in `Aggregate.shared_state`: each client picked
later receives them in the same map, beside its own (the names must differ). A Task sends
tensors back beside its weights in `TrainResult.extras`; the strategy reads them with
`ClientResult.load_extras()` and reads what a client was sent with `ctx.client_state(client)`.

SCAFFOLD (option II) on the client. The round config holds ``scaffold: true`` and
`ctx.client_state` the controls ``c.<param>`` (the server's) and ``c_i.<param>`` (the
client's), absent (zero) until first sent. fedmq's loop adds c − c_i to every parameter's
gradient before each SGD step and returns ``dc.<param>`` = c_i⁺ − c_i in `TrainResult.extras`,
where c_i⁺ = c_i − c + (x − y)/(K·lr) after K steps from the global x to y. A Task with its own
`train` does the same with `fedmq.Controls` (plain SGD steps only):

    controls = fedmq.Controls.for_round(model, ctx)  # None unless the round config says scaffold
    for batch in batches:
        ...; loss.backward()
        if controls:
            controls.correct()                       # + (c − c_i) on every gradient
        optimizer.step()
    extras = controls.extras() if controls else {}   # dc.<param>
    return fedmq.TrainResult(n, metrics, extras=extras)

`current` is read-only (the live global model, not a copy): return new tensors; an in-place
edit of it fails the round, naming the tensor. `client_state` and `shared_state` go to
learners only when ``sends_client_state = True``: returning them without it is an error.

Rules that keep runs reproducible: results come in client order whatever order they arrived
in; draw randomness only from `ctx.generator(...)`; keep state across rounds only in what
`state()` returns (an aggregator restarted from a checkpoint has nothing else); metrics are
plain floats named like ``[A-Za-z_][A-Za-z0-9_.]*``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

StateDict = dict[str, "torch.Tensor"]
Config = dict[str, float | int | str | bool]

# Keys of a round's config that fedmq itself reads on the learner.
PROXIMAL_MU = "proximal_mu"  # FedProx's mu: fedmq's loop adds mu/2·||w − w_global||²
SCAFFOLD = "scaffold"  # true: fedmq's loop corrects gradients with the client state's controls
CLIENT_STATE = "client_state"  # true: the learner fetches the client's stored state
# CLIENT_STATE's value when learners make all of it (the Task's state, topk's residual; no strategy
# state): the learner that made a client's state may use its own copy (learner/statecache.py).
LEARNER_STATE = "learner"


# One client's new state in `Aggregate.client_state`: the map itself, or a callable making it.
ClientState = Mapping[str, "torch.Tensor"] | Callable[[], Mapping[str, "torch.Tensor"]]


def made(value: ClientState) -> Mapping[str, torch.Tensor]:
    """A client state as its map: a callable is called (each call makes it anew)."""
    return value() if callable(value) else value


def _nothing() -> Mapping[str, torch.Tensor]:
    return {}


def _no_state(client: int) -> StateDict:
    return {}


@dataclass(frozen=True)
class RoundContext:
    """The round a strategy configures or aggregates, and the job around it."""

    round: int  # the round being configured or closed, 1 .. rounds
    rounds: int  # the job's total
    seed: int  # the job's seed
    num_clients: int  # logical clients in the job
    clients: tuple[int, ...] = ()  # the clients whose updates are aggregated (empty in configure)
    reader: Callable[[int], StateDict] = field(default=_no_state, repr=False, compare=False)

    def generator(self, *keys: str | int) -> torch.Generator:
        """A CPU generator on the stream (seed, "strategy", round, *keys): the same in every run."""
        from fedmq.common.seeding import torch_generator

        return torch_generator(self.seed, "strategy", self.round, *keys)

    def client_state(self, client: int) -> StateDict:
        """What `client` is sent in this round: its state kept at its last round before this one, and
        the newest shared state before this round ({} if none)."""
        return self.reader(client)


@dataclass(frozen=True)
class ClientResult:
    """One client's accepted update. Tensors are read from disk only when loaded, one client at a time."""

    client: int
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    loader: Callable[[], Mapping[str, torch.Tensor]] = field(default=_nothing, repr=False)
    extras_loader: Callable[[], Mapping[str, torch.Tensor]] = field(default=_nothing, repr=False)

    def load(self) -> Mapping[str, torch.Tensor]:
        """The client's new weights, name → tensor (each tensor is read when looked up)."""
        return self.loader()

    def load_extras(self) -> Mapping[str, torch.Tensor]:
        """The extra tensors the client's training returned (`TrainResult.extras`), lazily too."""
        return self.extras_loader()


@dataclass(frozen=True)
class ClientFailed:
    """A sampled client that sent no update this round, and why."""

    client: int
    reason: str
    phase: str  # where it failed: a Task method ("train", "load_data"), "invalid", "error" or "timeout"


@dataclass
class Aggregate:
    """What `aggregate` returns."""

    weights: Mapping[str, torch.Tensor]  # the new global state dict (every tensor of the model)
    metrics: dict[str, float] = field(default_factory=dict)  # shown as source "strategy"
    # Kept for each client's next round: its map, or a callable making it when fedmq writes it.
    client_state: Mapping[int, ClientState] = field(default_factory=dict)
    shared_state: StateDict = field(default_factory=dict)  # sent to every client picked later, beside its own


@dataclass(frozen=True)
class JobFacts:
    """What `Strategy.check_job` may read of a job: the spec's numbers, before anything runs."""

    clients_total: int  # logical clients in the job
    clients_per_round: int  # clients sampled each round
    min_fit: int  # the fewest updates a round may close with (the quorum)
    rounds: int
    optimizer: str  # train.optimizer: "sgd" or "adam"
    lr: float
    momentum: float
    weight_decay: float


class StrategyOptions(BaseModel):
    """Base of a strategy's `Options`: unknown options are errors, values immutable. Alone: no options."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Strategy(ABC):
    """Base class of every server strategy; see the module docstring for the contract."""

    Options: ClassVar[type[StrategyOptions]] = StrategyOptions  # a subclass of StrategyOptions
    # Whether learners receive each client's stored state (Aggregate.client_state) with its task.
    sends_client_state: ClassVar[bool] = False
    # The names of the extras clients must send (None: whatever they send, within fedmq's limits).
    expected_extras: ClassVar[frozenset[str] | None] = None

    options: StrategyOptions

    def __init__(self, options: StrategyOptions | None = None) -> None:
        self.options = options if options is not None else self.Options()

    @classmethod
    def check_job(cls, options: StrategyOptions, job: JobFacts) -> None:
        """Refuse a job this strategy cannot run with `options` (too few clients for f, an optimizer
        its maths does not hold for): raise ValueError saying what to change. fedmq calls it where
        the job is checked before it is published (the CLI, the Python API) and when the aggregator
        takes the job, so a setting that could only fail after round 1 fails at once. Accepts
        everything by default."""
        return None

    def configure(self, ctx: RoundContext) -> Config:
        """The round's config sent to every client with its task ({} by default)."""
        return {}

    @abstractmethod
    def aggregate(
        self,
        ctx: RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[ClientResult],
        failures: Sequence[ClientFailed],
    ) -> Aggregate:
        """The next global model from the current one and the round's results (in client order).

        `current` is read-only: it is the live global model. Build new tensors (``current[k] +
        step``, ``current[k].clone()``); an in-place edit (``current[k].add_(...)``) fails the round.
        """

    def state(self) -> StateDict:
        """Tensors to checkpoint beside the global weights (moments, control variates)."""
        return {}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:  # noqa: B027 - stateless: nothing
        """Restore what `state()` returned (after a restart, or after a failed round is undone)."""
