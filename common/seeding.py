"""Seed streams: every random choice draws from one derived from (seed, purpose, round, client).

    derive_seed(42, "partition")          -> one stream for the data split
    derive_seed(42, "train", 3, 17)       -> round 3, client 17's shuffling

The derivation hashes a canonical encoding with BLAKE2b, so it is the same in every
process, on every platform and in every Python version (unlike ``hash()``).
"""

from __future__ import annotations

import hashlib
import operator
from typing import TYPE_CHECKING, SupportsIndex

import numpy as np

if TYPE_CHECKING:
    import torch

SEED_BITS = 63
_MASK = (1 << SEED_BITS) - 1


def _encode(key: object) -> bytes:
    # Tag each key with its type and length so ("1",) and (1,) or ("ab","c") and ("a","bc") differ.
    if isinstance(key, str):
        tag, body = b"s", key.encode("utf-8")
    elif isinstance(key, bool | float) or not hasattr(key, "__index__"):
        raise TypeError(f"seed keys must be str or int, got {type(key).__name__}")
    else:
        # operator.index accepts numpy integers too, so np.int64(3) and 3 give the same stream.
        tag, body = b"i", str(operator.index(key)).encode("ascii")
    return tag + len(body).to_bytes(4, "big") + body


def derive_seed(seed: SupportsIndex, *keys: str | SupportsIndex) -> int:
    """A 63-bit non-negative seed derived from ``seed`` and ``keys``, stable across processes."""
    digest = hashlib.blake2b(digest_size=8, person=b"fedmq-seed")
    digest.update(_encode(seed))
    for key in keys:
        digest.update(_encode(key))
    return int.from_bytes(digest.digest(), "big") & _MASK


def secret_seed(key: bytes, seed: SupportsIndex, *keys: str | SupportsIndex) -> int:
    """As derive_seed, keyed with a secret: no one without `key` can compute it from the public values."""
    digest = hashlib.blake2b(digest_size=8, key=key[:64], person=b"fedmq-secret")
    digest.update(_encode(seed))
    for part in keys:
        digest.update(_encode(part))
    return int.from_bytes(digest.digest(), "big") & _MASK


def numpy_rng(seed: SupportsIndex, *keys: str | SupportsIndex) -> np.random.Generator:
    """A numpy Generator on the stream derived from ``seed`` and ``keys``."""
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: SupportsIndex, *keys: str | SupportsIndex) -> torch.Generator:
    """A CPU torch Generator on the stream derived from ``seed`` and ``keys``."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(derive_seed(seed, *keys))
    return generator
