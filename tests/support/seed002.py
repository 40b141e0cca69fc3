"""Seed 002's semantics run in one process, for comparing fedmq.compat.miniray with: the workers
alive through the whole training, their weights averaged every `sync` epochs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def living(make: Callable[[int], Any], workers: int, sync: int, epochs: int) -> Any:
    """Worker 0, with the last synced weights, after `epochs` epochs of `workers` living workers
    (each `make(worker_id)`, its shard loaded), set to the synced weights at each sync's start."""
    alive = [make(i) for i in range(workers)]
    for i, worker in enumerate(alive):
        worker.load_data_shard(i, workers)
    synced = alive[0].get_weights()
    for epoch in range(epochs):
        if epoch % sync == 0:
            for worker in alive:
                worker.set_weights(synced)
        for worker in alive:
            worker.train_epoch(epoch)
        if epoch % sync == sync - 1:
            synced = [torch.stack(ws).mean(0) for ws in zip(*(w.get_weights() for w in alive), strict=True)]
    alive[0].set_weights(synced)
    return alive[0]
