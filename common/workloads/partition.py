"""Split a dataset's samples over logical clients: iid, Dirichlet label skew, or label shards.

Every kind assigns every sample to exactly one client and is a pure function of
(labels, num_clients, spec, seed), so any learner replica recomputes the same split.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from fedmq.common.errors import ConfigError
from fedmq.common.seeding import numpy_rng


class _Kind(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class IidPartition(_Kind):
    """Every client gets an equal share of a random permutation."""

    kind: Literal["iid"] = "iid"


class DirichletPartition(_Kind):
    """Label skew (Hsu et al. 2019): per class, Dir(alpha) shares over clients."""

    kind: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0)
    min_size: int = Field(1, ge=0, description="resample until every client has this many samples")


class ShardsPartition(_Kind):
    """McMahan et al. 2017: label-sorted shards, a few per client."""

    kind: Literal["shards"] = "shards"
    shards_per_client: int = Field(2, gt=0)


PartitionSpec = IidPartition | DirichletPartition | ShardsPartition
Partition = Annotated[PartitionSpec, Field(discriminator="kind")]

# Resampling Dirichlet draws until every client is big enough must end somewhere.
MAX_DIRICHLET_TRIES = 1000


def partition(
    labels: np.ndarray, num_clients: int, spec: PartitionSpec, seed: int
) -> list[np.ndarray]:
    """Per client, the sorted int64 indices of its samples; the parts cover every index once."""
    labels = _check_labels(labels)
    n = len(labels)
    if num_clients < 1:
        raise ConfigError(f"clients.total must be at least 1, got {num_clients}")
    if num_clients > n:
        raise ConfigError(
            f"clients.total ({num_clients}) exceeds the {n} training samples; "
            f"lower clients.total to at most {n}"
        )
    rng = numpy_rng(seed, "partition")
    if isinstance(spec, IidPartition):
        parts = np.array_split(rng.permutation(n), num_clients)
    elif isinstance(spec, DirichletPartition):
        parts = _dirichlet(labels, num_clients, spec, rng)
    elif isinstance(spec, ShardsPartition):
        parts = _shards(labels, num_clients, spec, rng)
    else:
        raise ConfigError(f"unknown partition kind {getattr(spec, 'kind', spec)!r}")
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(
            f"labels must be a 1-D integer array, got shape {labels.shape} dtype {labels.dtype}"
        )
    return labels


def _dirichlet(
    labels: np.ndarray, num_clients: int, spec: DirichletPartition, rng: np.random.Generator
) -> list[np.ndarray]:
    """Hsu et al. 2019 as in FedML: per class, Dir(alpha) shares over clients."""
    n = len(labels)
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    smallest = 0
    for _ in range(MAX_DIRICHLET_TRIES):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for members in by_class:
            shuffled = rng.permutation(members)
            shares = rng.dirichlet(np.full(num_clients, spec.alpha))
            # FedML's balancing step: a client already holding its fair share takes no more.
            open_shares = np.where(sizes < n / num_clients, shares, 0.0)
            total = open_shares.sum()
            if total > 0 and np.isfinite(total):
                shares = open_shares / total
            else:
                # Tiny alpha can underflow every open share to zero; fall back to the open clients.
                shares = (sizes < n / num_clients).astype(np.float64)
                shares /= shares.sum()
            cuts = (np.cumsum(shares) * len(shuffled)).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(shuffled, cuts)):
                buckets[client].append(chunk)
                sizes[client] += len(chunk)
        smallest = int(sizes.min())
        if smallest >= spec.min_size:
            return [np.concatenate(b) for b in buckets]
    raise ConfigError(
        f"dirichlet partition could not give each of {num_clients} clients at least "
        f"{spec.min_size} sample(s) in {MAX_DIRICHLET_TRIES} tries (smallest got {smallest}); "
        f"raise data.partition.alpha (now {spec.alpha}), lower data.partition.min_size "
        f"or lower clients.total"
    )


def _shards(
    labels: np.ndarray, num_clients: int, spec: ShardsPartition, rng: np.random.Generator
) -> list[np.ndarray]:
    """McMahan et al. 2017: sort by label, cut into shards, deal each client a few at random."""
    n = len(labels)
    num_shards = num_clients * spec.shards_per_client
    if num_shards > n:
        raise ConfigError(
            f"shards partition needs clients.total x shards_per_client = {num_shards} shards "
            f"but there are only {n} training samples; lower data.partition.shards_per_client "
            f"or clients.total"
        )
    shuffled = rng.permutation(n)
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    shards = np.array_split(by_label, num_shards)
    dealt = rng.permutation(num_shards).reshape(num_clients, spec.shards_per_client)
    return [np.concatenate([shards[s] for s in row]) for row in dealt]


def label_skew(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> float:
    """Mean total-variation distance between each client's label mix and the global one.

    0 when every client sees the global mix; it grows towards 1 as clients see fewer
    classes. Clients with no samples are left out.
    """
    labels = _check_labels(labels)
    global_mix = np.bincount(labels, minlength=num_classes) / max(len(labels), 1)
    distances = [
        0.5 * np.abs(np.bincount(labels[p], minlength=num_classes) / len(p) - global_mix).sum()
        for p in parts
        if len(p) > 0
    ]
    return float(np.mean(distances)) if distances else 0.0
