"""A model state, a name -> tensor map such as a state_dict: encoded, decoded and digested."""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from fedmq.common.codec.pack import DEFAULT_MAX_BYTES, packb, unpackb
from fedmq.common.codec.tensors import tensor_parts
from fedmq.common.errors import DecodeError

if TYPE_CHECKING:
    import torch

DIGEST_PIECE = 8 * 1024 * 1024  # bytes of tensor data hashed as one piece of state_digest's tree
DIGEST_THREADS = min(8, os.cpu_count() or 1)  # threads that hash a large state's pieces


def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """Encode a name -> tensor mapping, such as a model's state_dict, keeping its order."""
    import torch

    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state entries must be str -> Tensor, got {name!r} -> {type(tensor)}")
    return packb(dict(state))


def decode_state(
    data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> dict[str, torch.Tensor]:
    """Decode bytes from encode_state; tensors are read-only views, clone before writing."""
    import torch

    obj = unpackb(data, max_bytes=max_bytes)
    if not isinstance(obj, dict):
        raise DecodeError(f"state must be a map, got {type(obj).__name__}")
    for name, tensor in obj.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise DecodeError(f"state entry {name!r} is not str -> Tensor")
    return obj


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """Hex sha256 over sorted names, dtypes, shapes and the sha256 of each DIGEST_PIECE bytes of each
    tensor's raw data: bitwise-equal states match.

    A tree of one level, so that the pieces of a large model hash on several threads at once
    (hashlib lets go of the GIL): a round's close digests the new model while its learners wait.
    The digest is the same however many threads computed it."""
    digest = hashlib.sha256(b"fedmq.state_digest.v2\0")
    digest.update(struct.pack("<Q", len(state)))
    names = sorted(state)
    # A file's tensors (each access reads it afresh: codec.TensorFile) are hashed one at a time, so
    # that the whole model is never in memory at once; the same digest either way.
    for group in ([[name] for name in names] if getattr(state, "owned_reads", False) else [names]):
        _add_tensors(digest, [(name.encode(), *tensor_parts(state[name])) for name in group])
    return digest.hexdigest()


def _add_tensors(digest: hashlib._Hash, parts: list[tuple[bytes, bytes, memoryview]]) -> None:
    """Each (name, header, data) into `digest`, in order, its data as the digests of its pieces."""
    pieces = [data[at:at + DIGEST_PIECE]
              for _, _, data in parts for at in range(0, data.nbytes, DIGEST_PIECE)]
    # A small state hashes at once: threads would cost more than they save (one close a round).
    large = sum(piece.nbytes for piece in pieces) > 2 * DIGEST_PIECE
    threads = min(DIGEST_THREADS, len(pieces)) if large else 1
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="digest") as pool:
            hashed = iter(pool.map(_sha256, pieces))
    else:
        hashed = map(_sha256, pieces)
    for encoded_name, header, data in parts:
        # Length prefixes keep the stream unambiguous; the header fixes the data length, and so
        # the number of piece digests that follow it.
        digest.update(struct.pack("<Q", len(encoded_name)))
        digest.update(encoded_name)
        digest.update(header)
        for _ in range(0, data.nbytes, DIGEST_PIECE):
            digest.update(next(hashed))


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()
