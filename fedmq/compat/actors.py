"""Seed 002's BaseTrainer and its actor calls, for a training loop of your own in this process.

    @miniray.remote
    class CustomWorker:
        def __init__(self, worker_id): ...
        def custom_method(self, epoch) -> float: ...

    class CustomTrainer(miniray.BaseTrainer):
        def create_worker(self, worker_id, **kwargs):
            return CustomWorker.remote(worker_id)

        def train_epoch(self, epoch, **kwargs):
            results = miniray.get([w.custom_method.remote(epoch) for w in self.workers])
            return {"custom_metric": sum(results) / len(results)}

    with CustomTrainer(num_workers=4) as trainer:
        out = trainer.train(epochs=10)      # {"history", "workers", "num_epochs"}

A BaseTrainer runs your `train_epoch` as written: its workers are built once, live for the whole
`train()` and keep everything they hold. `Cls.remote(...)` builds a worker and
`worker.method.remote(...)` calls a method at once, in this process, handing back a `Ref` that
`get` opens. There are no rounds here for fedmq to spread over learners: DataParallelTrainer
(a BaseTrainer whose epochs are fedmq's rounds) is the one that runs on a cluster, and it takes
workers built with `.remote` too.
"""

from __future__ import annotations

import inspect
import time
from types import TracebackType
from typing import Any, Self

__all__ = ["Actor", "BaseTrainer", "Ref", "get", "remote", "unwrap"]

class Ref:
    """A `.remote` call's result, already computed (seed 002's object reference)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def get(refs: Any) -> Any:
    """The value of a `Ref`, or of each in a list or tuple (anything else as it is)."""
    if isinstance(refs, list | tuple):
        return [get(ref) for ref in refs]
    return refs.value if isinstance(refs, Ref) else refs


class _Method:
    def __init__(self, bound: Any) -> None:
        self._bound = bound

    def remote(self, *args: Any, **kwargs: Any) -> Ref:
        return Ref(self._bound(*args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._bound(*args, **kwargs)


class Actor:
    """A worker as seed 002's actor: `actor.method.remote(...)` runs `method` now and gives a `Ref`;
    `actor.method(...)` and `actor.attribute` reach the worker itself (`unwrap` gives it)."""

    def __init__(self, worker: Any) -> None:
        object.__setattr__(self, "_worker", worker)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and the like ask for these: the worker's are not ours
            raise AttributeError(name)
        value = getattr(object.__getattribute__(self, "_worker"), name)
        # Its methods take .remote; anything else (a model, which is callable too) is itself
        return _Method(value) if inspect.ismethod(value) or inspect.isbuiltin(value) else value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_worker"), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(object.__getattribute__(self, "_worker"), name)

    def __reduce__(self) -> Any:
        raise TypeError("an Actor is not pickled: fedmq never pickles (unwrap gives the worker)")

    def __repr__(self) -> str:
        return f"Actor({object.__getattribute__(self, '_worker')!r})"


def remote(cls: type) -> Any:
    """Seed 002's `@miniray.remote` on a worker class: `cls.remote(*args)` builds an `Actor` (the
    class, as typed, becomes Any: a type checker cannot see the method it gains)."""

    def build(owner: type, *args: Any, **kwargs: Any) -> Actor:
        return Actor(owner(*args, **kwargs))

    setattr(cls, "remote", classmethod(build))  # noqa: B010 - an attribute the class does not declare
    return cls


def unwrap(worker: Any) -> Any:
    """The worker an `Actor` holds (anything else as it is)."""
    return object.__getattribute__(worker, "_worker") if isinstance(worker, Actor) else worker


class BaseTrainer:
    """Subclass it, define `create_worker(worker_id, **kwargs)` and `train_epoch(epoch, **kwargs)`;
    see the module docstring."""

    def __init__(self, num_workers: int = 4) -> None:
        self.num_workers = num_workers
        self.workers: list[Any] = []
        self.num_epochs = 0

    def create_worker(self, worker_id: int, **kwargs: Any) -> Any:
        raise NotImplementedError("define create_worker(worker_id, **kwargs) returning your worker")

    def train_epoch(self, epoch: int, **kwargs: Any) -> dict[str, Any]:
        raise NotImplementedError("define train_epoch(epoch, **kwargs) returning the epoch's results")

    def on_train_start(self, **kwargs: Any) -> None: ...
    def on_epoch_start(self, epoch: int, **kwargs: Any) -> None: ...
    def on_epoch_end(self, epoch: int, result: dict[str, Any], **kwargs: Any) -> None: ...

    def on_train_end(self, history: list[dict[str, Any]], **kwargs: Any) -> Any:
        """What `train()` returns: by default seed 002's {"history", "workers", "num_epochs"}."""
        return {"history": history, "workers": self.workers, "num_epochs": self.num_epochs}

    def train(self, epochs: int, **kwargs: Any) -> Any:
        """Build the workers, then `train_epoch` each epoch between the hooks; returns
        on_train_end(history), each entry an epoch's results with its `epoch` and `time` (seconds)."""
        self.workers = [self.create_worker(i, **kwargs) for i in range(self.num_workers)]
        self.on_train_start(**kwargs)
        history = []
        for epoch in range(epochs):
            self.on_epoch_start(epoch, **kwargs)
            started = time.perf_counter()
            result = dict(self.train_epoch(epoch, **kwargs) or {})
            result = {"epoch": epoch, "time": time.perf_counter() - started, **result}
            history.append(result)
            self.on_epoch_end(epoch, result, **kwargs)
        self.num_epochs = epochs
        return self.on_train_end(history, **kwargs)

    def shutdown(self) -> None:
        """Nothing to stop: the workers live in this process."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
