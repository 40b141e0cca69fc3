"""Which clients train in a round: a seeded draw, the same on every run."""

from __future__ import annotations

from fedmq.common.seeding import numpy_rng


def sample_clients(seed: int, server_round: int, total: int, k: int) -> list[int]:
    """k distinct client ids out of range(total), sorted, drawn from (seed, 'sample', round)."""
    if k >= total:
        return list(range(total))
    rng = numpy_rng(seed, "sample", server_round)
    return sorted(int(c) for c in rng.choice(total, size=k, replace=False))
