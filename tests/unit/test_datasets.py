"""Loading datasets: bundled digits, seeded stratified splits and user loaders."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import DataSpec
from fedmq.common.workloads.datasets import Dataset, load_dataset

DIGITS = DataSpec(name="digits", test_fraction=0.2)


def test_digits_has_the_documented_shapes_dtypes_and_labels() -> None:
    ds = load_dataset(DIGITS, seed=0)
    assert ds.num_classes == 10
    assert ds.input_shape == (1, 8, 8)
    assert len(ds.x_train) + len(ds.x_test) == 1797
    assert ds.x_train.shape[1:] == ds.x_test.shape[1:] == (1, 8, 8)
    assert ds.x_train.dtype == ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == ds.y_test.dtype == np.int64
    assert ds.y_train.shape == (len(ds.x_train),)
    assert np.isfinite(ds.x_train).all() and np.isfinite(ds.x_test).all()
    assert set(np.unique(ds.y_train)) == set(range(10))


def test_digits_pixels_are_standardised_with_training_statistics() -> None:
    ds = load_dataset(DIGITS, seed=0)
    mean, std = ds.x_train.mean(axis=0), ds.x_train.std(axis=0)
    assert np.allclose(mean, 0.0, atol=1e-5)
    # Pixels that are constant over the training split (the corners) stay at zero.
    assert np.allclose(std[std > 1e-3], 1.0, atol=1e-4)
    assert abs(float(ds.x_test.mean())) < 0.2


def test_digits_test_split_is_stratified_by_class() -> None:
    ds = load_dataset(DataSpec(test_fraction=0.3), seed=1)
    all_labels = np.concatenate([ds.y_train, ds.y_test])
    expected = np.bincount(all_labels, minlength=10) * 0.3
    assert np.all(np.abs(np.bincount(ds.y_test, minlength=10) - expected) <= 1)


def test_digits_train_and_test_do_not_overlap() -> None:
    ds = load_dataset(DIGITS, seed=0)
    train = {x.tobytes() + bytes([y]) for x, y in zip(ds.x_train, ds.y_train, strict=True)}
    test = {x.tobytes() + bytes([y]) for x, y in zip(ds.x_test, ds.y_test, strict=True)}
    # digits holds a handful of exact duplicate images, so allow a few collisions.
    assert len(train & test) <= 5


def test_the_same_seed_gives_the_same_split() -> None:
    first = load_dataset(DIGITS, seed=3)
    again = load_dataset(DataSpec(name="digits", test_fraction=0.2), seed=3)
    assert np.array_equal(first.y_test, again.y_test)
    assert np.array_equal(first.x_test, again.x_test)


def test_different_seeds_give_different_splits() -> None:
    first = load_dataset(DIGITS, seed=3)
    second = load_dataset(DIGITS, seed=4)
    assert not np.array_equal(first.x_test, second.x_test)


def test_loaded_arrays_are_shared_and_read_only() -> None:
    first = load_dataset(DIGITS, seed=0)
    assert load_dataset(DIGITS, seed=0) is first
    with pytest.raises(ValueError):
        first.x_train[0] = 0.0
    assert first.x_train[[0, 1]].flags.writeable, "indexing gives a private, writable copy"


def test_an_entrypoint_dataset_is_loaded_with_seed_and_options() -> None:
    spec = DataSpec(
        entrypoint="examples.plugins.my_model:load",
        options={"num_samples": 90, "num_classes": 3, "num_features": 4},
        test_fraction=0.2,
    )
    ds = load_dataset(spec, seed=5)
    assert (ds.num_classes, ds.input_shape) == (3, (4,))
    assert ds.x_train.shape == (72, 4) and ds.x_test.shape == (18, 4)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64


def mapping_loader(seed: int, test_fraction: float) -> dict[str, Any]:
    """A loader returning a plain mapping with float64 inputs and int32 labels."""
    rng = np.random.default_rng(seed)
    return {
        "x_train": rng.normal(size=(8, 2, 3)),
        "y_train": np.arange(8, dtype=np.int32) % 4,
        "x_test": rng.normal(size=(4, 2, 3)),
        "y_test": np.arange(4, dtype=np.int32),
    }


def test_a_mapping_result_is_coerced_and_its_shapes_inferred() -> None:
    ds = load_dataset(DataSpec(entrypoint=f"{__name__}:mapping_loader"), seed=0)
    assert isinstance(ds, Dataset)
    assert (ds.num_classes, ds.input_shape) == (4, (2, 3))
    assert ds.x_test.dtype == np.float32 and ds.y_test.dtype == np.int64


def ragged_loader(seed: int, test_fraction: float) -> dict[str, Any]:
    return {
        "x_train": np.zeros((8, 3), np.float32),
        "y_train": np.zeros(7, np.int64),
        "x_test": np.zeros((2, 3), np.float32),
        "y_test": np.zeros(2, np.int64),
    }


def float_label_loader(seed: int, test_fraction: float) -> dict[str, Any]:
    return {**ragged_loader(seed, test_fraction), "y_train": np.zeros(8, np.float32)}


def list_loader(seed: int, test_fraction: float) -> list[int]:
    return [1, 2, 3]


def strict_loader(seed: int) -> dict[str, Any]:
    return {}


@pytest.mark.parametrize(
    ("func", "message"),
    [
        ("ragged_loader", "must be"),
        ("float_label_loader", "integer class labels"),
        ("list_loader", "expected a Dataset or a mapping"),
        ("strict_loader", "cannot be called"),
    ],
)
def test_a_bad_entrypoint_dataset_is_a_config_error_naming_it(func: str, message: str) -> None:
    ref = f"{__name__}:{func}"
    with pytest.raises(ConfigError, match=message) as info:
        load_dataset(DataSpec(entrypoint=ref), seed=0)
    assert ref in str(info.value)


def test_a_missing_entrypoint_dataset_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no_such_module"):
        load_dataset(DataSpec(entrypoint="no_such_module:load"), seed=0)
