"""User plug-ins: resolve `package.module:function` references and the contracts they meet.

A job spec may name a user's own model builder, dataset loader or local training
function instead of a built-in one:

    model: {entrypoint: "my_pkg.nets:build", options: {width: 64}}
    data:  {entrypoint: "my_pkg.data:load", options: {...}}
    train: {entrypoint: "my_pkg.train:train"}

`examples/plugins/my_model.py` is a complete example of all three.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from fedmq.common.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fedmq.common.jobspec import TrainSpec
    from fedmq.common.workloads.datasets import Dataset


class ModelBuilder(Protocol):
    """Builds an untrained `nn.Module` mapping (B, *input_shape) to (B, num_classes) logits.

    Called inside a forked, seeded torch RNG, so plain `nn.Linear(...)` initialisation
    is already reproducible. `options` from the spec arrive as keyword arguments.
    """

    def __call__(
        self, *, input_shape: tuple[int, ...], num_classes: int, **options: Any
    ) -> nn.Module: ...


class DatasetLoader(Protocol):
    """Returns a `Dataset` (or a mapping with its fields) with a train and a test split.

    Must be deterministic in `seed`: every learner replica calls it and all must agree.
    `options` from the spec arrive as keyword arguments.
    """

    def __call__(
        self, *, seed: int, test_fraction: float, **options: Any
    ) -> Dataset | dict[str, Any]: ...


class LocalTrainFn(Protocol):
    """One client's local training: the shape of a data-parallel worker.

    The caller sets the global weights into `model` (already on `device`), calls this
    function, then reads the trained weights back with `model.state_dict()`; the
    function trains `model` in place and must not replace its parameters.

    - `x`, `y`: the client's whole shard as CPU tensors (float32 inputs of shape
      (N, *input_shape), int64 labels of shape (N,)); move batches to `device`.
    - `train`: the job's `train` section (epochs, batch_size, max_steps, optimizer, lr, ...).
    - `generator`: a CPU generator seeded for this (job, round, client); draw every random
      choice (shuffling, dropout masks you sample yourself) from it so runs reproduce.

    Returns metrics over the samples trained on, at least {"loss": ..., "accuracy": ...};
    any other float entries are reported alongside.
    """

    def __call__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        train: TrainSpec,
        generator: torch.Generator,
        device: torch.device,
    ) -> dict[str, float]: ...


def load_entrypoint(ref: str) -> Callable[..., Any]:
    """Import `package.module:function` and return the callable, or raise ConfigError saying why."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(f"entrypoint {ref!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and _is_prefix(exc.name, module_name):
            raise ConfigError(
                f"entrypoint {ref!r}: module {module_name!r} not found "
                f"(no module named {exc.name!r}); is it installed or on PYTHONPATH? "
                f"(working directory: {os.getcwd()})"
            ) from None
        raise ConfigError(
            f"entrypoint {ref!r}: module {module_name!r} failed to import: {exc}"
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"entrypoint {ref!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(
                f"entrypoint {ref!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(target):
        raise ConfigError(
            f"entrypoint {ref!r}: {attr_path!r} is a {type(target).__name__}, not callable"
        )
    return target


def check_arguments(func: Callable[..., Any], ref: str, **kwargs: Any) -> None:
    """Raise ConfigError if `func` cannot be called with these keyword arguments."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return  # builtins and C extensions without a signature: let the call decide
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"entrypoint {ref!r} cannot be called with arguments "
            f"({', '.join(sorted(kwargs))}): {exc}"
        ) from None


def _is_prefix(missing: str, module_name: str) -> bool:
    """True when the missing module is the requested one or one of its parent packages."""
    return module_name == missing or module_name.startswith(missing + ".")
