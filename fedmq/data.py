"""Helpers for a Task's `load_data`: seeded splits and partitions over logical clients.

    from fedmq.data import DirichletPartition, partition, stratified_split

    train, test = stratified_split(labels, 0.2, seed)                    # sorted index arrays
    parts = partition(labels[train], num_clients, DirichletPartition(alpha=0.5), seed)
    mine = train[parts[ctx.client]]

Each is a pure function of its arguments, so every process that asks gets the same answer.
"""

from fedmq.common.workloads.partition import (
    DirichletPartition,
    IidPartition,
    Partition,
    PartitionSpec,
    ShardsPartition,
    label_skew,
    partition,
)
from fedmq.common.workloads.splits import random_split, stratified_split

__all__ = [
    "DirichletPartition",
    "IidPartition",
    "Partition",
    "PartitionSpec",
    "ShardsPartition",
    "label_skew",
    "partition",
    "random_split",
    "stratified_split",
]
