"""Seed 002's Mini-Ray Train API on fedmq: your workers, fedmq's rounds, embedded or on a cluster.

    class MyWorker:                                   # seed 002's worker, unchanged
        def __init__(self, worker_id): ...
        def load_data_shard(self, shard_id, num_shards, **kwargs): ...
        def train_epoch(self, epoch) -> dict: ...
        def get_weights(self) -> list[Tensor]: ...
        def set_weights(self, weights): ...

    class MyTrainer(DataParallelTrainer):
        def create_worker(self, worker_id, **kwargs):
            return MyWorker(worker_id)

    with MyTrainer(num_workers=4, sync_interval=2, sync_strategy="weighted") as trainer:
        trainer.set_worker_weight(0, 2.0)
        out = trainer.train(epochs=20, batch_size=32)  # {"history", "workers", "num_epochs"}

How it maps: each worker is a client (`clients.total = num_workers`, all train each round); a
round runs `sync_interval` epochs of `train_epoch` and then syncs; `average`, `weighted` and
`momentum` are the strategies `average`, `weighted` (the weights you set, normalised; a worker
without one counts 1) and `moving_average` (w = m·w_prev + (1 − m)·average, the first sync a
plain average). Unlike upstream, the global weights are broadcast before the first epoch, so
workers start equal however they are built. A worker is built for every round from the trainer
class (its constructor arguments are recorded), then given back what a living worker keeps: each
of its `nn.Module` attributes' parameters and buffers (BatchNorm's statistics), each optimizer's
state (momentum, Adam's moments) and each `torch.Generator`'s state, kept as its client's state
between rounds (the same on every learner, and after any crash); then the synced weights. Other
attributes (a Python counter, a list) start afresh each round. Optional: define
`evaluate(self, worker)` on the trainer to report metrics of the synced weights (it runs where
the aggregator runs, on a worker freshly built: its BatchNorm statistics are the initial ones).
Keyword arguments of `train()` reach `create_worker` and `load_data_shard`, as in seed 002. The
trainer's and `train()`'s arguments travel to the learners as JSON: anything else is refused at
once, naming the argument. `on_train_start` runs before the job is built (a `set_worker_weight`
there counts).
`create_worker` may return `MyWorker.remote(...)` (a class under `@miniray.remote`), as seed 002's
examples do. `BaseTrainer` (actors.py), with `remote` and `get`, runs a training loop of your own
in this process.
Hooks follow syncs, not single epochs: with `sync_interval` > 1, `on_epoch_start` gets the
round's first epoch and `on_epoch_end` its last, with seed 002's `epoch`, `time` (the round's
seconds), `synced`, `sync_version` (the syncs so far) and `worker_results` (each worker's numeric
results of that epoch, by worker id; empty past 64 workers), with that epoch's numeric results
averaged over the workers
(earlier epochs of the round are not reported); the history has one entry per sync.
"""

from __future__ import annotations

import json
import math
import threading
import warnings
from collections.abc import Mapping
from types import TracebackType
from typing import Any, ClassVar, Self

import torch
from torch import nn

import fedmq
from fedmq.common.codec.pack import packb, unpackb
from fedmq.common.errors import ConfigError, FedmqError
from fedmq.common.refs import import_ref, ref_of
from fedmq.common.usercode import UserCodeError
from fedmq.compat.actors import Actor, BaseTrainer, Ref, get, remote, unwrap

__all__ = ["Actor", "BaseTrainer", "DataParallelTrainer", "Ref", "get", "remote", "unwrap"]

STRATEGIES = {"average": "average", "weighted": "weighted", "momentum": "moving_average"}


class DataParallelTrainer(BaseTrainer):
    """Subclass it and define `create_worker(worker_id, **kwargs)`; see the module docstring. Its
    epochs are fedmq's rounds: the workers' own `train_epoch` runs, not the trainer's."""

    _init: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> DataParallelTrainer:
        for i, value in enumerate(args):
            _check_travels(value, f"{cls.__name__}(): positional argument {i}")
        for name, value in kwargs.items():
            _check_travels(value, f"{cls.__name__}(): argument {name!r}")
        self = super().__new__(cls)
        self._init = (args, kwargs)  # so every process can build the same trainer again
        return self

    def __init__(
        self,
        num_workers: int = 4,
        sync_interval: int = 1,
        sync_strategy: str = "average",
        *,
        broker: str | None = None,
        seed: int = 0,
        **strategy_kwargs: Any,
    ) -> None:
        if sync_strategy not in STRATEGIES:
            raise ValueError(f"sync_strategy must be one of {', '.join(STRATEGIES)}, got {sync_strategy!r}")
        super().__init__(num_workers)  # self.workers, after train(): the trained ones (`_trained_workers`)
        self.sync_interval, self.sync_strategy = sync_interval, sync_strategy
        self.broker, self.seed, self.strategy_kwargs = broker, seed, strategy_kwargs
        self.worker_weights: dict[int, float] = {}
        self.result: fedmq.Result | None = None
        self._runner: fedmq.Runner | None = None

    # -- what a subclass writes: create_worker, and the hooks (BaseTrainer's) -----------------

    # -- the trainer's API --------------------------------------------------------------------

    def set_worker_weight(self, worker_id: int, weight: float) -> None:
        """The weight of a worker's parameters in a `weighted` sync (before `train`)."""
        self.worker_weights[worker_id] = float(weight)

    def train(self, epochs: int, **kwargs: Any) -> Any:
        """Train for `epochs` epochs, syncing every `sync_interval`; returns on_train_end(history)."""
        if getattr(_building, "trainer", None):
            raise RuntimeError(
                f"{type(self).__name__}.train() ran while fedmq imported {_building.trainer!r} for its "
                "trainer class: the script starts training at import. Put the training under "
                "`if __name__ == \"__main__\":`")
        if type(self).train_epoch is not BaseTrainer.train_epoch:
            raise TypeError(
                f"{type(self).__name__} defines train_epoch, which a DataParallelTrainer never runs (its "
                "epochs are the workers' train_epoch, synced as fedmq rounds): subclass "
                "miniray.BaseTrainer for a training loop of your own")
        for name, value in kwargs.items():
            _check_travels(value, f"train(): argument {name!r}")
        self.on_train_start(**kwargs)  # first: a weight it sets goes into the job
        job = self.job(epochs, **kwargs)
        trainer, history = self, []

        class Hooks(fedmq.Callback):
            def on_round_start(self, round: int) -> None:
                trainer.on_epoch_start(_first_epoch(round, trainer.sync_interval), **kwargs)

            def on_round_end(self, round: int, record: fedmq.RoundRecord) -> None:
                if round == 0:
                    return
                epoch = min(_first_epoch(round + 1, trainer.sync_interval), epochs) - 1
                result = {  # the workers' averaged and the server's metrics, then seed 002's fields
                    **record.metrics.get("train", {}),
                    **record.metrics.get("server", {}),
                    "epoch": epoch,
                    "time": record.seconds,
                    "synced": True,
                    "sync_version": round,
                    "worker_results": [dict(record.client_metrics.get(worker, {}))
                                       for worker in range(trainer.num_workers)],
                }
                history.append(result)
                trainer.on_epoch_end(epoch, result, **kwargs)

        if self._runner is not None:
            self.result = self._runner.run(job, callbacks=[Hooks()])
        else:
            self.result = fedmq.run(job, broker=self.broker, callbacks=[Hooks()])
        if not self.result.ok:
            raise RuntimeError(f"training {self.result.status}: {self.result.reason}")
        self.workers, self.num_epochs = self._workers_or_none(self.result, kwargs), epochs
        return self.on_train_end(history, **kwargs)

    def _workers_or_none(self, result: fedmq.Result, kwargs: dict[str, Any]) -> list[Any]:
        """`_trained_workers`; over a broker, [] with a warning when this process cannot build them
        (its broker user may not read client state, or lacks the learners' FEDMQ_STATE_KEY): the
        training went well, and `trainer.result` has its weights."""
        if self.broker is None:
            return self._trained_workers(result, kwargs)
        try:
            return self._trained_workers(result, kwargs)
        except UserCodeError:  # the user's own worker code, run here: its error is theirs to see
            raise
        except (FedmqError, TimeoutError) as exc:
            warnings.warn(f"the trained workers could not be built here ({exc}); train() returns no "
                          "workers: trainer.result.weights() has the synced weights", stacklevel=3)
            return []

    def _trained_workers(self, result: fedmq.Result, kwargs: dict[str, Any]) -> list[Any]:
        """Each worker as training left it, built again in this process (its `load_data_shard` runs
        here) and given its kept state (modules, optimizers, generators: `worker_state`) and the
        final synced weights. Over a broker the state comes from the aggregator (with the learners'
        FEDMQ_STATE_KEY in this process where they seal it)."""
        weights = [tensor for _, tensor in sorted(result.weights("final").items(), key=_index)]
        workers = []
        for worker_id in range(self.num_workers):
            built = self.create_worker(worker_id, **kwargs)  # as you built it: an Actor from .remote
            worker = unwrap(built)
            if hasattr(worker, "load_data_shard"):
                worker.load_data_shard(worker_id, self.num_workers, **kwargs)
            load_worker_state(worker, result.client_state(worker_id))
            worker.set_weights([w.clone() for w in weights])
            workers.append(built)
        return workers

    def job(self, epochs: int, **kwargs: Any) -> fedmq.Job:
        """The fedmq job `train(epochs, **kwargs)` runs."""
        args, init = self._init
        strategy_options: dict[str, Any] = {}
        if self.sync_strategy == "weighted":
            strategy_options["weights"] = [self.worker_weights.get(i, 1.0) for i in range(self.num_workers)]
        if self.sync_strategy == "momentum":
            strategy_options["momentum"] = float(self.strategy_kwargs.get("momentum", 0.9))
        strategy = {"name": STRATEGIES[self.sync_strategy], "options": strategy_options}
        options = {
            "trainer": ref_of(type(self)),
            "args": list(args),
            "init": init,
            "kwargs": kwargs,
            "sync_interval": self.sync_interval,
            "epochs": epochs,
        }
        return fedmq.Job.model_validate(
            {
                "name": type(self).__name__.lower(),
                "seed": self.seed,
                "rounds": math.ceil(epochs / self.sync_interval),
                "task": {"name": WorkerTask, "options": options},
                "clients": {"total": self.num_workers},
                "strategy": strategy,
            }
        )

    def get_sync_stats(self) -> dict[str, Any]:
        """How many syncs, the bytes each way, and time in training, transfer and aggregation."""
        if self.result is None:
            return {}
        stats = self.result.sync_stats
        return {"num_syncs": stats.rounds, **{k: v for k, v in vars(stats).items() if k != "rounds"}}

    def shutdown(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def __enter__(self) -> Self:
        self._runner = fedmq.Runner(self.broker).__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()


class WeightsModule(nn.Module):
    """A worker's weight list as a module: what fedmq checkpoints, sends and averages."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            [nn.Parameter(w.detach().clone(), requires_grad=False) for w in weights]
        )

    def tensors(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.weights]


class WorkerTask(fedmq.Task):
    """The fedmq Task that runs a DataParallelTrainer's workers (built by `DataParallelTrainer.job`).

    A worker is built each round, and what a living worker would keep comes back from its client
    state (`worker_state`): its modules' parameters and buffers, its optimizers' state, its
    generators. Then the synced weights go in with `set_weights`."""

    metric_reduction: ClassVar[Mapping[str, Any]] = {}
    keeps_state = True

    def __init__(
        self,
        trainer: str,
        args: list[Any],
        init: dict[str, Any],
        kwargs: dict[str, Any],
        sync_interval: int,
        epochs: int,
    ) -> None:
        _building.trainer = trainer  # its module's top level must not start a training
        try:
            cls = import_ref(trainer, what="trainer")  # checked against the allow-list in force
        finally:
            _building.trainer = None
        if not (isinstance(cls, type) and issubclass(cls, DataParallelTrainer)):
            raise ConfigError(
                f"trainer {trainer!r} is a {type(cls).__name__}, not a subclass of DataParallelTrainer"
            )
        self.trainer: DataParallelTrainer = cls(*args, **init)
        self.kwargs, self.sync_interval, self.epochs = kwargs, sync_interval, epochs

    def build_model(self) -> nn.Module:
        return WeightsModule(unwrap(self.trainer.create_worker(0, **self.kwargs)).get_weights())

    def load_data(self, ctx: fedmq.DataContext) -> int:
        return ctx.client  # a worker loads its own shard when it is built, each round

    def load_server_data(self, ctx: fedmq.DataContext) -> int | None:
        return 0 if callable(getattr(self.trainer, "evaluate", None)) else None

    def train(self, model: nn.Module, data: int, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        assert isinstance(model, WeightsModule)
        worker = self._worker(data, model, ctx.state)
        first = _first_epoch(ctx.round, self.sync_interval)
        results = [
            worker.train_epoch(epoch) for epoch in range(first, min(first + self.sync_interval, self.epochs))
        ]
        new = list(worker.get_weights())
        _check_weights(new, model.tensors())
        with torch.no_grad():
            for param, value in zip(model.weights, new, strict=True):
                param.copy_(value)
        numeric = {k: float(v) for k, v in (results[-1] if results else {}).items() if _is_number(v)}
        ctx.state.clear()
        ctx.state.update(worker_state(worker))
        return fedmq.TrainResult(num_examples=1, metrics=numeric)

    def evaluate(self, model: nn.Module, data: Any, ctx: fedmq.EvalContext) -> dict[str, float]:
        assert isinstance(model, WeightsModule)
        return dict(self.trainer.evaluate(self._worker(0, model)))  # type: ignore[attr-defined]

    def _worker(self, worker_id: int, model: WeightsModule, state: Mapping[str, Any] | None = None) -> Any:
        worker = unwrap(self.trainer.create_worker(worker_id, **self.kwargs))
        if hasattr(worker, "load_data_shard"):
            worker.load_data_shard(worker_id, self.trainer.num_workers, **self.kwargs)
        if state:
            load_worker_state(worker, state)
        worker.set_weights(model.tensors())
        return worker


def worker_state(worker: Any) -> dict[str, torch.Tensor]:
    """What a living worker keeps, as client-state tensors: each `nn.Module` attribute's state_dict
    (parameters and buffers: BatchNorm's statistics), each optimizer's state_dict (packed as fedmq's
    messages are, msgpack with tensors, in a byte tensor: no pickle) and each generator's state."""
    out: dict[str, torch.Tensor] = {}
    for name, value in vars(worker).items():
        if isinstance(value, nn.Module):
            out |= {f"{name}.module.{k}": v.detach().clone() for k, v in value.state_dict().items()}
        elif isinstance(value, torch.optim.Optimizer):
            packed = bytearray(packb(value.state_dict()))
            out[f"{name}.optimizer"] = torch.frombuffer(packed, dtype=torch.uint8)
        elif isinstance(value, torch.Generator):
            out[f"{name}.generator"] = value.get_state()
    return out


def load_worker_state(worker: Any, state: Mapping[str, Any]) -> None:
    """`worker_state`'s tensors back into a freshly built worker's attributes of the same names."""
    for name, value in vars(worker).items():
        if isinstance(value, nn.Module):
            prefix = f"{name}.module."
            own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if own:
                value.load_state_dict(own)
        elif isinstance(value, torch.optim.Optimizer) and f"{name}.optimizer" in state:
            packed = unpackb(state[f"{name}.optimizer"].numpy().tobytes())
            value.load_state_dict(_owned(packed))
        elif isinstance(value, torch.Generator) and f"{name}.generator" in state:
            value.set_state(state[f"{name}.generator"])


def _owned(tree: Any) -> Any:
    """An unpacked tree with each tensor copied out of the message's bytes (the optimizer writes them)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: _owned(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_owned(value) for value in tree]
    return tree


_building = threading.local()  # .trainer: the trainer ref WorkerTask is importing in this thread


def _check_travels(value: Any, where: str) -> None:
    """TypeError (one line) unless `value` can travel to every learner as JSON."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{where} is a {type(value).__name__}, which cannot travel to the learners ({exc}): pass "
            "numbers, strings, lists or dicts, and build objects inside create_worker") from None


def _check_weights(new: list[Any], first: list[torch.Tensor]) -> None:
    """ValueError naming the worker method and the numbers when its weights do not fit the first sync's."""
    if len(new) != len(first):
        raise ValueError(f"get_weights returned {len(new)} tensors, the first sync had {len(first)}")
    for i, (value, was) in enumerate(zip(new, first, strict=True)):
        if not isinstance(value, torch.Tensor) or value.shape != was.shape:
            what = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"get_weights()[{i}] is {what}, the first sync's is {list(was.shape)}")


def _index(item: tuple[str, torch.Tensor]) -> int:
    """A WeightsModule's tensor name ("weights.<i>") to its place in the worker's list."""
    return int(item[0].rpartition(".")[2])


def _first_epoch(server_round: int, sync_interval: int) -> int:
    return (server_round - 1) * sync_interval


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
