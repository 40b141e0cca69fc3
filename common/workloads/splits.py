"""Seeded train/test splits of a labelled dataset: the same in every process."""

from __future__ import annotations

import numpy as np

from fedmq.common.seeding import numpy_rng


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices with each class's test share rounded from test_fraction."""
    rng = numpy_rng(seed, "split")
    test_parts = []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        test_parts.append(members[: int(round(len(members) * test_fraction))])
    test = np.sort(np.concatenate(test_parts)).astype(np.int64)
    train = np.setdiff1d(np.arange(len(labels), dtype=np.int64), test, assume_unique=True)
    return train, test


def random_split(
    size: int, test_fraction: float, seed: int, *keys: str | int
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices of `size` examples, the test share drawn from (seed, *keys)."""
    order = numpy_rng(seed, "split", *keys).permutation(size)
    cut = int(round(size * test_fraction))
    return np.sort(order[cut:]).astype(np.int64), np.sort(order[:cut]).astype(np.int64)
