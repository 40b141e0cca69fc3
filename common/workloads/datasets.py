"""Datasets as numpy arrays: bundled `digits` or a user's loader, split into train/test by seed."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import DataSpec
from fedmq.common.seeding import numpy_rng
from fedmq.common.workloads.plugins import check_arguments, load_entrypoint


@dataclass(frozen=True)
class Dataset:
    """A train and a test split. Arrays returned by `load_dataset` are shared and read-only.

    Index them (`x_train[idx]` copies) or `np.array(...)` them before changing them in place.
    """

    x_train: np.ndarray  # float32, (N, *input_shape)
    y_train: np.ndarray  # int64, (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]


def load_dataset(spec: DataSpec, seed: int) -> Dataset:
    """The dataset a job names, split with the job seed; cached per (spec, seed) in this process."""
    return _load_cached(_CacheKey(spec.model_dump_json(), seed, spec))


@dataclass(frozen=True)
class _CacheKey:
    # DataSpec holds a dict of options, so it is not hashable: hash and compare its JSON.
    spec_json: str
    seed: int
    spec: DataSpec = field(compare=False, hash=False)


@functools.lru_cache(maxsize=8)
def _load_cached(key: _CacheKey) -> Dataset:
    spec, seed = key.spec, key.seed
    # `name` keeps its default when `entrypoint` is given, so the entrypoint decides first.
    if spec.entrypoint is not None:
        dataset = _from_entrypoint(spec, seed)
    elif spec.name == "digits":
        dataset = _digits(spec.test_fraction, seed)
    else:
        raise ConfigError("data: give a dataset 'name' (digits) or an 'entrypoint'")
    for array in (dataset.x_train, dataset.y_train, dataset.x_test, dataset.y_test):
        array.setflags(write=False)
    return dataset


def _digits(test_fraction: float, seed: int) -> Dataset:
    from sklearn.datasets import load_digits

    raw = load_digits()
    x = (raw.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = raw.target.astype(np.int64)
    train, test = stratified_split(y, test_fraction, seed)
    # Standardise each pixel with the training split's statistics (sklearn's StandardScaler
    # convention): SGD on raw [0, 1] pixels converges several times slower.
    mean = x[train].mean(axis=0, keepdims=True)
    std = x[train].std(axis=0, keepdims=True)
    x = ((x - mean) / np.where(std > 1e-6, std, 1.0)).astype(np.float32)
    return Dataset(x[train], y[train], x[test], y[test], num_classes=10, input_shape=(1, 8, 8))


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices with each class's test share rounded from test_fraction."""
    rng = numpy_rng(seed, "split")
    test_parts = []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        test_parts.append(members[: int(round(len(members) * test_fraction))])
    test = np.sort(np.concatenate(test_parts)).astype(np.int64)
    train = np.setdiff1d(np.arange(len(labels), dtype=np.int64), test, assume_unique=True)
    return train, test


def _from_entrypoint(spec: DataSpec, seed: int) -> Dataset:
    ref = spec.entrypoint or ""
    loader = load_entrypoint(ref)
    kwargs: dict[str, Any] = {"seed": seed, "test_fraction": spec.test_fraction, **spec.options}
    check_arguments(loader, ref, **kwargs)
    result = loader(**kwargs)
    if isinstance(result, Dataset):
        result = {f.name: getattr(result, f.name) for f in fields(Dataset)}
    if not isinstance(result, Mapping):
        raise ConfigError(
            f"dataset entrypoint {ref!r} returned {type(result).__name__}; "
            f"expected a Dataset or a mapping with x_train, y_train, x_test, y_test"
        )
    return _validated(dict(result), ref)


def _validated(raw: dict[str, Any], ref: str) -> Dataset:
    """Coerce a loader's output to float32/int64 and check it is a usable classification set."""

    def fail(problem: str) -> ConfigError:
        return ConfigError(f"dataset entrypoint {ref!r}: {problem}")

    missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in raw]
    if missing:
        raise fail(f"result lacks {', '.join(missing)}")
    arrays: dict[str, np.ndarray] = {}
    for split in ("train", "test"):
        x, y = np.asarray(raw[f"x_{split}"]), np.asarray(raw[f"y_{split}"])
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise fail(f"x_{split} must be numeric, got dtype {x.dtype}")
        if not np.issubdtype(y.dtype, np.integer):
            raise fail(f"y_{split} must hold integer class labels, got dtype {y.dtype}")
        if y.ndim != 1 or x.ndim < 2 or len(x) != len(y) or len(y) == 0:
            raise fail(
                f"x_{split} {x.shape} and y_{split} {y.shape} must be (N, ...) and (N,) with N > 0"
            )
        # Copies, so freezing the cached arrays never touches the loader's own buffers.
        arrays[f"x_{split}"] = np.array(x, dtype=np.float32, order="C")
        arrays[f"y_{split}"] = np.array(y, dtype=np.int64, order="C")
        if not np.isfinite(arrays[f"x_{split}"]).all():
            raise fail(f"x_{split} holds NaN or infinite values")
    input_shape = tuple(int(d) for d in raw.get("input_shape") or arrays["x_train"].shape[1:])
    for split in ("train", "test"):
        if arrays[f"x_{split}"].shape[1:] != input_shape:
            raise fail(
                f"x_{split} samples have shape {arrays[f'x_{split}'].shape[1:]}, "
                f"expected input_shape {input_shape}"
            )
    labels = np.concatenate([arrays["y_train"], arrays["y_test"]])
    num_classes = int(raw.get("num_classes") or labels.max() + 1)
    if labels.min() < 0 or labels.max() >= num_classes:
        raise fail(f"labels must lie in [0, {num_classes}), got {labels.min()}..{labels.max()}")
    return Dataset(**arrays, num_classes=num_classes, input_shape=input_shape)
