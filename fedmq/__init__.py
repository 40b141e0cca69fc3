"""fedmq: federated learning and data-parallel training as services over RabbitMQ.

The public interface lives here:

    import fedmq

    class MyTask(fedmq.Task): ...             # the workload (fedmq.Task's docstring)
    job = fedmq.Job(name="demo", task=MyTask, clients={"total": 10}, rounds=20)
    result = fedmq.run(job)                    # in this process; broker="amqp://..." for a cluster

The installed package holds everything under this one name: `fedmq.common` (the shared kernel:
settings, messages, codec, bus, job spec, the Task machinery) and `fedmq.services`
(scheduler, aggregator, learner, CLI). Importing `fedmq` does not import torch.
"""

from fedmq.common.task.contract import (
    ClientData,
    DataContext,
    EvalContext,
    EvalResult,
    Objective,
    Task,
    TrainContext,
    TrainResult,
    TrainSettings,
)

__version__ = "0.2.0"


def load_model(path: str) -> object:
    """A saved model file as an `nn.Module` in eval mode, rebuilt by its job's Task (safetensors)."""
    from fedmq.common.checkpoint import load_model as load

    return load(path)


__all__ = [
    "ClientData",
    "DataContext",
    "EvalContext",
    "EvalResult",
    "Objective",
    "Task",
    "TrainContext",
    "TrainResult",
    "TrainSettings",
    "__version__",
    "load_model",
]
