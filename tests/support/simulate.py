"""FedAvg in one loop, without the services: for tuning example Tasks and checking their maths.

    spec = load_job("examples/regression.yaml")
    run = simulate(spec)                    # run.history[r] == {"server": {...}, "train": {...}}
    pooled = simulate(centralised(spec))    # the same model and budget on the pooled data

It calls the Task exactly as the services do, through TaskRuntime (seeded, checked), with the
same seed streams: initial weights, the scheduler's client sample, each client's generator
torch_generator(seed, "train", round, client), and the aggregator's example-weighted mean.
It does not promise the services' bit-exact weights (their transport and fold order are theirs);
it promises the same maths.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedmq.common.jobspec import JobSpec, parse_job
from fedmq.common.seeding import torch_generator
from fedmq.common.task.contract import ClientData, EvalContext, TrainContext, TrainSettings
from fedmq.common.task.metrics import reduce_metrics
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.aggregator.kernels import weighted_mean
from fedmq.services.scheduler.sampling import sample_clients

CPU = torch.device("cpu")
Metrics = dict[str, dict[str, float]]  # {source: {name: value}}


@dataclass
class Simulation:
    """What a simulated job leaves: per-round metrics (round 0 is the initial model) and the model."""

    runtime: TaskRuntime
    model: nn.Module
    history: list[Metrics] = field(default_factory=list)
    seconds: float = 0.0  # wall-clock, everything
    cpu_seconds: float = 0.0  # this process's CPU time: steadier than wall-clock on a busy machine
    train_seconds: float = 0.0  # inside TaskRuntime.train only

    @property
    def final(self) -> Metrics:
        return self.history[-1]


def settings(spec: JobSpec) -> TrainSettings:
    """The spec's train section as the Task sees it."""
    return TrainSettings.from_spec(spec.train)


def simulate(
    spec: JobSpec,
    *,
    data_dir: Path | None = None,
    on_round: Callable[[int, Metrics], None] | None = None,
) -> Simulation:
    """Run the job's rounds of FedAvg on one CPU; see the module docstring."""
    started, cpu_started = time.perf_counter(), time.process_time()
    runtime = TaskRuntime.for_job(spec)
    model = runtime.build_model()
    run = Simulation(runtime, model)
    server_data = runtime.load_server_data(data_dir) if spec.evaluate.server else None
    cache: dict[int, ClientData] = {}

    def data(client: int) -> ClientData:
        if client not in cache:
            cache[client] = runtime.load_data(client, data_dir)
        return cache[client]

    def record(server_round: int, metrics: Metrics) -> None:
        if spec.evaluates(server_round):
            metrics.update(evaluate(runtime, model, server_round, server_data, data))
        run.history.append(metrics)
        if on_round is not None:
            on_round(server_round, metrics)

    record(0, {})
    for server_round in range(1, spec.rounds + 1):
        global_weights = {k: v.clone() for k, v in model.state_dict().items()}
        results: list[tuple[dict[str, torch.Tensor], int, dict[str, float]]] = []
        for client in sample_clients(spec.seed, server_round, spec.clients.total, spec.clients.sampled):
            model.load_state_dict(global_weights)
            ctx = TrainContext(
                client=client,
                round=server_round,
                seed=spec.seed,
                train=settings(spec),
                device=CPU,
                generator=torch_generator(spec.seed, "train", server_round, client),
                global_weights=global_weights,
            )
            client_data = data(client)
            t0 = time.perf_counter()
            result = runtime.train(model, client_data, ctx)
            run.train_seconds += time.perf_counter() - t0
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            results.append((state, result.num_examples, dict(result.metrics)))
        model.load_state_dict(weighted_mean((s, float(n)) for s, n, _ in results))
        train = reduce_metrics(((n, m) for _, n, m in results), runtime.reductions)
        record(server_round, {"train": train})
    run.seconds = time.perf_counter() - started
    run.cpu_seconds = time.process_time() - cpu_started
    return run


def evaluate(
    runtime: TaskRuntime,
    model: nn.Module,
    server_round: int,
    server_data: Any,
    data: Callable[[int], ClientData],
) -> Metrics:
    """Server evaluation on the Task's server data, and federated evaluation if the spec asks."""
    spec, out = runtime.spec, {}
    if server_data is not None:
        ctx = EvalContext(round=server_round, seed=spec.seed, device=CPU)
        out["server"] = dict(runtime.evaluate(model, server_data, ctx).metrics)
    federated = spec.evaluate.federated
    if federated is not None:
        reports = []
        chosen = sample_clients(spec.seed, -server_round - 1, spec.clients.total, federated.clients)
        for client in chosen:
            val = data(client).val
            if val is not None:
                ctx = EvalContext(round=server_round, seed=spec.seed, device=CPU, client=client)
                result = runtime.evaluate(model, val, ctx)
                reports.append((result.num_examples, dict(result.metrics)))
        out["federated"] = reduce_metrics(reports, runtime.reductions)
    return out


def with_changes(spec: JobSpec, **changes: Any) -> JobSpec:
    """The spec with top-level fields replaced (dicts merge one level deep), validated again."""
    raw = spec.model_dump(exclude_none=True)
    for key, value in changes.items():
        merge = isinstance(value, dict) and isinstance(raw.get(key), dict)
        raw[key] = {**raw[key], **value} if merge else value
    return parse_job(raw)


def centralised(spec: JobSpec) -> JobSpec:
    """The same job with one client holding the pooled training data (a Task's 1-client split)."""
    one = {"total": 1, "per_round": 1, "min_fit": 1}
    return with_changes(spec, clients=one, evaluate={"federated": None})
