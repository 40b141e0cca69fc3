"""fedmq: federated learning and data-parallel training as services over RabbitMQ.

The public interface lives here:

    import fedmq

    class MyTask(fedmq.Task): ...             # the workload (fedmq.Task's docstring)
    class MyStrategy(fedmq.Strategy): ...     # optional: the server's algorithm (fedmq.Strategy's module)
    job = fedmq.Job(name="demo", task=MyTask, clients={"total": 10}, rounds=20)
    result = fedmq.run(job)                    # in this process; broker="amqp://..." for a cluster

The installed package holds everything under this one name: `fedmq.common` (the shared kernel:
settings, messages, codec, bus, job spec, the Task machinery) and `fedmq.services`
(scheduler, aggregator, learner, CLI). Importing `fedmq` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedmq.common.strategy.contract import (
    Aggregate,
    ClientFailed,
    ClientResult,
    JobFacts,
    RoundContext,
    Strategy,
    StrategyOptions,
)
from fedmq.common.task.contract import (
    ClientData,
    DataContext,
    DpSgd,
    EvalContext,
    EvalResult,
    ExportContext,
    Objective,
    Task,
    TrainContext,
    TrainResult,
    TrainSettings,
)

__version__ = "0.2.0"

# Loaded on first use, so that `import fedmq` stays light (no torch, no services).
_LAZY = {
    "Job": ("fedmq.common.jobspec", "Job"),
    "run": ("fedmq.services.api.runner", "run"),
    "Runner": ("fedmq.services.api.runner", "Runner"),
    "Callback": ("fedmq.services.api.runner", "Callback"),
    "Result": ("fedmq.services.api.result", "Result"),
    "RoundRecord": ("fedmq.services.api.result", "RoundRecord"),
    "SyncStats": ("fedmq.services.api.result", "SyncStats"),
    "Controls": ("fedmq.common.task.scaffold", "Controls"),  # SCAFFOLD in a Task's own train
}

if TYPE_CHECKING:
    from torch import nn

    from fedmq.common.jobspec import Job
    from fedmq.common.task.scaffold import Controls
    from fedmq.services.api.result import Result, RoundRecord, SyncStats
    from fedmq.services.api.runner import Callback, Runner, run


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fedmq' has no attribute {name!r}")


def load_model(path: str) -> nn.Module:
    """A saved model file as an `nn.Module` in eval mode, rebuilt by its job's Task (safetensors)."""
    from fedmq.common.checkpoint import load_model as load

    return load(path)


__all__ = [
    "Aggregate",
    "Callback",
    "ClientData",
    "ClientFailed",
    "ClientResult",
    "Controls",
    "DataContext",
    "DpSgd",
    "EvalContext",
    "EvalResult",
    "ExportContext",
    "Job",
    "JobFacts",
    "Objective",
    "Result",
    "RoundContext",
    "RoundRecord",
    "Runner",
    "Strategy",
    "StrategyOptions",
    "SyncStats",
    "Task",
    "TrainContext",
    "TrainResult",
    "TrainSettings",
    "__version__",
    "load_model",
    "run",
]
