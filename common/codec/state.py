"""A model state, a name -> tensor map such as a state_dict: encoded, decoded and digested."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING

from fedmq.common.codec.pack import DEFAULT_MAX_BYTES, packb, unpackb
from fedmq.common.codec.tensors import tensor_parts
from fedmq.common.errors import DecodeError

if TYPE_CHECKING:
    import torch


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
    """Hex sha256 over sorted names, dtypes, shapes and raw bytes: bitwise-equal states match."""
    digest = hashlib.sha256(b"fedmq.state_digest.v1\0")
    digest.update(struct.pack("<Q", len(state)))
    for name in sorted(state):
        encoded_name = name.encode()
        header, data = tensor_parts(state[name])
        # Length prefixes keep the stream unambiguous; the header fixes the data length.
        digest.update(struct.pack("<Q", len(encoded_name)))
        digest.update(encoded_name)
        digest.update(header)
        digest.update(data)
    return digest.hexdigest()
