"""A plain FedAvg loop written from the paper, the oracle the services are compared against.

FedAvg is Algorithm 1 of McMahan et al. 2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data": each round the server sends w to a sample of clients;
client k runs E epochs of minibatch SGD on its n_k examples; the server's new w is
sum_k (n_k / n) w_k. FedAvgM (Hsu et al. 2019) adds a server step with momentum.

Shared with fedmq, because they define the problem rather than the algorithm: the seed
streams (`fedmq.common.seeding`), the job's Task (its model with fedmq's seeded initial
weights, each client's data, the held-out split) and each round's client sample
(`sample_clients`). Each has unit tests of its own, and computing
them afresh would only test that two copies agree. Written here afresh, and shared with
nothing in fedmq: local training (its own loop and SGD step; `torch.optim.Adam` for adam),
the weighted average, the FedAvgM server step, and accuracy. The only rule the training
shares is the one a reproducible run needs: round r, client k shuffles each epoch with
`torch.randperm(n_k, generator=torch_generator(seed, "train", r, k))`.

The float operations come in another order than the services' (a float64 average, plain
SGD arithmetic, one evaluation batch), so the services agree with this loop to within a
float tolerance (`tests/conftest.py`), not bit for bit. It trains classifiers (cross-entropy on
(x, y) batches), as the digits Task and the test Tasks built on it are: their own `train`
methods only delay, gate or fail the built-in training.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from fedmq.common.jobspec import JobSpec, TrainSpec
from fedmq.common.seeding import torch_generator
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.scheduler.sampling import sample_clients

Weights = dict[str, torch.Tensor]


def reference_fedavg(spec: JobSpec) -> dict[str, Any]:
    """Train `spec` in one loop: final weights, per-round accuracy, round times, test set size."""
    task = TaskRuntime.for_job(spec)
    model = task.build_model()
    x_test, y_test = task.load_server_data(None)
    w = _copy(model)
    velocity: Weights = {}
    accuracies, round_seconds = [], []
    for r in range(1, spec.rounds + 1):
        started = time.perf_counter()
        updates = []
        for k in sample_clients(spec.seed, r, spec.clients.total, spec.clients.sampled):
            model.load_state_dict(w)
            x, y = task.load_data(k, None).train
            client_update(model, x, y, spec.train, torch_generator(spec.seed, "train", r, k))
            updates.append((len(y), _copy(model)))
        if spec.strategy.name == "average":
            updates = [(1, w_k) for _, w_k in updates]
        averaged = weighted_average(updates)
        if spec.strategy.name == "fedavgm":
            options = spec.strategy.options  # the paper's defaults where the spec gives none
            averaged = server_momentum_step(
                w, averaged, velocity, float(options.get("server_lr", 1.0)),
                float(options.get("server_momentum", 0.9)),
            )
        w = averaged
        model.load_state_dict(w)
        accuracies.append(accuracy(model, x_test, y_test))
        round_seconds.append(time.perf_counter() - started)
    return {"weights": w, "accuracies": accuracies, "round_seconds": round_seconds,
            "test_examples": len(y_test)}


def client_update(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainSpec, generator: torch.Generator
) -> None:
    """E epochs over the client's data in shuffled minibatches of B, cross-entropy loss."""
    model.train()
    params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    adam = None
    if train.optimizer == "adam":
        adam = torch.optim.Adam(params, lr=train.lr, weight_decay=train.weight_decay)
    bufs: list[torch.Tensor | None] = [None] * len(params)  # SGD's momentum buffers
    steps = 0
    for _ in range(train.epochs):
        for batch in torch.randperm(len(x), generator=generator).split(train.batch_size):
            for p in params:
                p.grad = None
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            if adam is not None:
                adam.step()
            else:
                sgd_step(params, bufs, train.lr, train.momentum, train.weight_decay)
            steps += 1
            if steps == train.max_steps:
                return


@torch.no_grad()
def sgd_step(
    params: list[torch.Tensor], bufs: list[torch.Tensor | None], lr: float, mu: float, decay: float
) -> None:
    """w <- w - lr * v, with g = grad + decay * w and v = mu * v + g (v = g on the first step)."""
    for i, p in enumerate(params):
        assert p.grad is not None
        g = p.grad + decay * p if decay else p.grad
        if mu:
            before = bufs[i]
            g = g.clone() if before is None else mu * before + g
            bufs[i] = g
        p.sub_(lr * g)


def weighted_average(updates: list[tuple[int, Weights]]) -> Weights:
    """sum_k (n_k / n) w_k per tensor, in float64; integer tensors are rounded back."""
    n = sum(n_k for n_k, _ in updates)
    out: Weights = {}
    for name, like in updates[0][1].items():
        mean = sum(w_k[name].double() * (n_k / n) for n_k, w_k in updates)
        assert isinstance(mean, torch.Tensor)
        out[name] = (mean if like.is_floating_point() else mean.round()).to(like.dtype)
    return out


def server_momentum_step(
    w: Weights, averaged: Weights, velocity: Weights, lr: float, beta: float
) -> Weights:
    """FedAvgM: pseudo-gradient d = w - avg; v <- beta * v + d (v starts at 0); w <- w - lr * v.

    `velocity` is updated in place; integer tensors take the average.
    """
    out: Weights = {}
    for name, w_t in w.items():
        if not w_t.is_floating_point():
            out[name] = averaged[name]
            continue
        d = w_t - averaged[name]
        velocity[name] = beta * velocity[name] + d if name in velocity else d
        out[name] = w_t - lr * velocity[name]
    return out


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of test examples whose largest logit is their label."""
    model.eval()
    return int((model(x).argmax(dim=1) == y).sum()) / len(y)


def _copy(model: nn.Module) -> Weights:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}
