"""Partitioning samples over clients: coverage, determinism, skew and errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedmq.common.errors import ConfigError
from fedmq.data import (
    DirichletPartition,
    IidPartition,
    PartitionSpec,
    ShardsPartition,
    label_skew,
    partition,
)


@pytest.fixture(scope="module")
def digits_labels() -> np.ndarray:
    from sklearn.datasets import load_digits

    return load_digits().target.astype(np.int64)


SPECS: dict[str, PartitionSpec] = {
    "iid": IidPartition(),
    "dirichlet": DirichletPartition(alpha=0.5, min_size=0),
    "shards": ShardsPartition(shards_per_client=2),
}


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0), "each part is sorted without repeats"
    joined = np.concatenate(parts)
    assert len(joined) == n
    assert np.array_equal(np.sort(joined), np.arange(n))


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(sorted(SPECS)),
    n=st.integers(1, 300),
    num_classes=st.integers(1, 10),
    clients_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**63 - 1),
)
def test_every_sample_goes_to_exactly_one_client(
    kind: str, n: int, num_classes: int, clients_fraction: float, seed: int
) -> None:
    labels = np.random.default_rng(seed % 1000).integers(0, num_classes, size=n)
    num_clients = max(1, int(clients_fraction * n))
    spec = SPECS[kind]
    if isinstance(spec, ShardsPartition):
        assume(num_clients * spec.shards_per_client <= n)
    parts = partition(labels, num_clients, spec, seed)
    assert len(parts) == num_clients
    assert_exact_cover(parts, n)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_the_same_seed_gives_the_same_partition(kind: str, digits_labels: np.ndarray) -> None:
    first = partition(digits_labels, 20, SPECS[kind], seed=7)
    second = partition(digits_labels, 20, SPECS[kind], seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_different_seeds_give_different_partitions(kind: str, digits_labels: np.ndarray) -> None:
    first = partition(digits_labels, 20, SPECS[kind], seed=7)
    second = partition(digits_labels, 20, SPECS[kind], seed=8)
    assert not all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


def test_iid_parts_differ_in_size_by_at_most_one(digits_labels: np.ndarray) -> None:
    sizes = [len(p) for p in partition(digits_labels, 13, IidPartition(), seed=0)]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_skew_grows_as_alpha_falls(digits_labels: np.ndarray) -> None:
    def mean_skew(alpha: float) -> float:
        spec = DirichletPartition(alpha=alpha)
        return float(
            np.mean(
                [
                    label_skew(digits_labels, partition(digits_labels, 10, spec, seed), 10)
                    for seed in range(5)
                ]
            )
        )

    assert mean_skew(0.1) > mean_skew(1.0) > mean_skew(100.0)


def test_dirichlet_gives_every_client_at_least_min_size(digits_labels: np.ndarray) -> None:
    spec = DirichletPartition(alpha=0.3, min_size=10)
    parts = partition(digits_labels, 30, spec, seed=3)
    assert min(len(p) for p in parts) >= 10
    assert_exact_cover(parts, len(digits_labels))


def test_dirichlet_that_cannot_reach_min_size_says_to_raise_alpha() -> None:
    labels = np.arange(40) % 2
    with pytest.raises(ConfigError, match="alpha") as info:
        partition(labels, 40, DirichletPartition(alpha=0.01, min_size=1), seed=0)
    assert "clients.total" in str(info.value)


def test_shards_give_most_clients_two_or_three_classes(digits_labels: np.ndarray) -> None:
    parts = partition(digits_labels, 100, ShardsPartition(shards_per_client=2), seed=0)
    classes_seen = np.array([len(np.unique(digits_labels[p])) for p in parts])
    assert classes_seen.max() <= 2 * 2
    assert np.mean(classes_seen <= 3) >= 0.9
    assert label_skew(digits_labels, parts, 10) > 0.6


def test_shards_are_cut_into_near_equal_sizes(digits_labels: np.ndarray) -> None:
    sizes = [len(p) for p in partition(digits_labels, 50, ShardsPartition(shards_per_client=3), 1)]
    assert max(sizes) - min(sizes) <= 3


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_more_clients_than_samples_is_a_config_error_naming_clients_total(kind: str) -> None:
    with pytest.raises(ConfigError, match="clients.total"):
        partition(np.zeros(5, dtype=np.int64), 6, SPECS[kind], seed=0)


def test_shards_that_do_not_fit_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="shards_per_client"):
        partition(np.zeros(10, dtype=np.int64), 4, ShardsPartition(shards_per_client=3), seed=0)


def test_non_integer_labels_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="integer"):
        partition(np.zeros(10, dtype=np.float32), 2, IidPartition(), seed=0)


def test_label_skew_is_zero_for_identical_mixes_and_high_for_disjoint_classes() -> None:
    labels = np.array([0, 1, 0, 1])
    assert label_skew(labels, [np.array([0, 1]), np.array([2, 3])], 2) == 0.0
    assert label_skew(labels, [np.array([0, 2]), np.array([1, 3])], 2) == pytest.approx(0.5)


# Seed streams (common.seeding) are what make partitions reproducible; they live here
# because every partition test leans on them.


def test_derived_seeds_never_change_across_versions() -> None:
    from fedmq.common.seeding import derive_seed

    # Golden values: changing the derivation would silently change every persisted job.
    assert derive_seed(42) == 8812735988189493775
    assert derive_seed(42, "train", 3, 17) == 1790475855462437483


def test_derived_seeds_separate_purposes_rounds_and_clients() -> None:
    from fedmq.common.seeding import derive_seed

    seeds = {
        derive_seed(0, "partition"),
        derive_seed(0, "split"),
        derive_seed(1, "partition"),
        derive_seed(0, "train", 1, 2),
        derive_seed(0, "train", 2, 1),
        derive_seed(0, "train", 12),
        derive_seed(0, "train", "1", 2),
    }
    assert len(seeds) == 7
    assert all(0 <= s < 2**63 for s in seeds)


def test_numpy_integers_derive_the_same_seed_as_python_ints() -> None:
    from fedmq.common.seeding import derive_seed

    assert derive_seed(np.int64(5), "train", np.int32(3)) == derive_seed(5, "train", 3)
    with pytest.raises(TypeError):
        derive_seed(5, 1.5)  # type: ignore[arg-type]
