"""Data-parallel training of the digits MLP with torch.distributed: a DDP job's entry (seed 003).

A plain torch.distributed program: it reads its rank from the environment (init_method
"env://"), shards the data with DistributedSampler and wraps the model in
DistributedDataParallel. The same file runs under torchrun:

    torchrun --nproc-per-node 2 examples/ddp.py             # files in ddp-out/
    fedmq run examples/ddp.yaml                              # two learners, one process each
    fedmq submit examples/ddp.yaml --watch                   # on a deployment's learners

fedmq.ddp gives it the spec's options, a checkpoint to resume from after a restart, where to
save checkpoints and the final model (which fedmq then serves as the job's model), and a way
to report each epoch's loss (shown by `fedmq watch` and exported to Prometheus).
`reference_weights` trains the same model in one process on each step's combined batch: the
weights DDP must reach (within float error).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fedmq.ddp
from fedmq.tasks.digits import INPUT_SHAPE, NUM_CLASSES, mlp

DEFAULTS: dict[str, Any] = {"epochs": 3, "batch_size": 32, "lr": 0.05, "hidden": [64], "seed": 0,
                            "epoch_pause_s": 0.0}


def _data() -> TensorDataset:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images / 16.0, dtype=torch.float32).reshape(-1, *INPUT_SHAPE)
    return TensorDataset(x, torch.tensor(labels, dtype=torch.int64))


def _model(opts: dict[str, Any]) -> nn.Module:
    torch.manual_seed(opts["seed"])
    return mlp(INPUT_SHAPE, NUM_CLASSES, list(opts["hidden"]))


def main() -> None:
    opts = {**DEFAULTS, **fedmq.ddp.options()}
    backend = os.environ.get("FEDMQ_DDP_BACKEND", "gloo")
    dist.init_process_group(backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if backend == "nccl" else "cpu")
    model, start = _model(opts), 0
    resumed = fedmq.ddp.load_checkpoint()
    if resumed is not None:
        state, start = resumed
        model.load_state_dict(state)
    model = DistributedDataParallel(model.to(device))
    data = _data()
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=opts["seed"]
    )
    loader = DataLoader(data, batch_size=opts["batch_size"], sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=opts["lr"])
    for epoch in range(start, opts["epochs"]):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            mean_loss = float(total[0] / total[1])
            print(f"epoch {epoch + 1}/{opts['epochs']} loss {mean_loss:.4f}", flush=True)  # streams to watch
            fedmq.ddp.report(epoch + 1, {"loss": mean_loss}, total=opts["epochs"])  # watch, Prometheus
            fedmq.ddp.save_checkpoint(model.module.state_dict(), step=epoch + 1)
        time.sleep(opts["epoch_pause_s"])
    if rank == 0:
        fedmq.ddp.save_model(model.module.state_dict())
    dist.destroy_process_group()


def reference_weights(options: dict[str, Any], world_size: int) -> dict[str, torch.Tensor]:
    """One process, one model: each step the ranks' batches together, their mean losses averaged
    (what DDP's all-reduced gradients are), in DistributedSampler's order."""
    opts = {**DEFAULTS, **options}
    model, data = _model(opts), _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=opts["lr"])
    n, batch = len(data), opts["batch_size"]
    per_rank = math.ceil(n / world_size)
    for epoch in range(opts["epochs"]):
        g = torch.Generator()
        g.manual_seed(opts["seed"] + epoch)
        order = torch.randperm(n, generator=g).tolist()
        order += order[: per_rank * world_size - n]  # DistributedSampler pads to equal shares
        shares = [order[r::world_size] for r in range(world_size)]
        for start in range(0, per_rank, batch):
            optimizer.zero_grad()
            losses = []
            for share in shares:
                x, y = data[share[start:start + batch]]
                losses.append(nn.functional.cross_entropy(model(x), y))
            (torch.stack(losses).mean()).backward()
            optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


if __name__ == "__main__":
    main()
