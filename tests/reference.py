"""A plain single-process FedAvg loop: the oracle fedmq's services must agree with bit for bit.

It reuses fedmq's pure pieces (sampling, partitions, the local trainer, the kernel)
and none of its plumbing: no bus, no services, no disk.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fedmq.common.jobspec import JobSpec
from fedmq.common.seeding import torch_generator
from fedmq.common.workloads.datasets import load_dataset
from fedmq.common.workloads.models import build_model
from fedmq.common.workloads.partition import partition
from fedmq.services.aggregator.evaluation import evaluate
from fedmq.services.aggregator.strategies import ClientResult, build_strategy
from fedmq.services.learner.training import train_local
from fedmq.services.scheduler.sampling import sample_clients


def reference_fedavg(spec: JobSpec) -> dict[str, Any]:
    """Train `spec` in one loop; returns final weights, per-round accuracy and round times."""
    data = load_dataset(spec.data, spec.seed)
    parts = partition(data.y_train, spec.clients.total, spec.data.partition, spec.seed)
    model = build_model(spec.model, data.input_shape, data.num_classes, spec.seed)
    strategy = build_strategy(spec)
    x, y = torch.tensor(data.x_train), torch.tensor(data.y_train)
    x_test, y_test = torch.tensor(data.x_test), torch.tensor(data.y_test)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    accuracies, round_seconds = [], []
    for r in range(1, spec.rounds + 1):
        started = time.perf_counter()
        results = []
        for c in sample_clients(spec.seed, r, spec.clients.total, spec.clients.sampled):
            model.load_state_dict(weights)
            idx = torch.from_numpy(parts[c])
            train_local(model, x[idx], y[idx], spec.train, torch_generator(spec.seed, "train", r, c),
                        torch.device("cpu"))
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            results.append(ClientResult(client=c, num_examples=len(idx), load=lambda s=state: s))
        weights = strategy.aggregate(r, weights, results)
        model.load_state_dict(weights)
        accuracies.append(evaluate(model, x_test, y_test)[1])
        round_seconds.append(time.perf_counter() - started)
    return {"weights": weights, "accuracies": accuracies, "round_seconds": round_seconds}
