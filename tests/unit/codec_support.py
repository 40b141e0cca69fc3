"""Helpers shared by the codec tests: tensors with exact bits, comparisons, hand-made payloads."""

from __future__ import annotations

import contextlib
import math
import struct
from pathlib import Path
from typing import Any

import msgpack
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from fedmq.common.codec import TENSOR_EXT, packb, unpackb
from fedmq.common.errors import DecodeError

REPO_ROOT = Path(__file__).resolve().parents[2]

# Independent of the codec's own table: every dtype the codec promises, where this torch has it.
DTYPE_NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]  # fmt: skip
DTYPES = [getattr(torch, name) for name in DTYPE_NAMES if hasattr(torch, name)]
FUZZ = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor's values as a flat uint8 tensor, for bitwise comparison."""
    return tensor.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(actual: Any, expected: torch.Tensor) -> None:
    """Same dtype, same shape, same bits (so NaN payloads and -0.0 count)."""
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert torch.equal(bits(actual), bits(expected))


def assert_same_structure(actual: Any, expected: Any) -> None:
    """Recursive equality where tensors compare bitwise and tuples come back as lists."""
    if isinstance(expected, torch.Tensor):
        assert_same_tensor(actual, expected)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict)
        assert list(actual) == list(expected)
        for key in expected:
            assert_same_structure(actual[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list)
        assert len(actual) == len(expected)
        for got, want in zip(actual, expected, strict=True):
            assert_same_structure(got, want)
    else:
        assert type(actual) is type(expected)
        assert actual == expected


def tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor holding exactly the given bits (bools are masked to 0/1, the only valid values)."""
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if dtype == torch.bool:
        flat = flat & 1
    return flat.view(dtype).view(shape)


@st.composite
def tensors(draw: st.DrawFn, max_side: int = 4) -> torch.Tensor:
    """Tensors of any supported dtype and small shape (0-d and empty included) with random bits."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, max_side), max_size=4)))
    size = math.prod(shape) * dtype.itemsize
    return tensor_from_bytes(draw(st.binary(min_size=size, max_size=size)), dtype, shape)


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
    tensors(max_side=3),
)
structures = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=8) | st.integers(-1000, 1000), children, max_size=4),
    ),
    max_leaves=20,
)


def small_state() -> dict[str, torch.Tensor]:
    """A few tensors of different dtypes and ranks, for the malformed-input tests."""
    return {
        "conv.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "conv.bias": torch.tensor([1, 2], dtype=torch.int64),
        "scale": torch.tensor(0.5, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "empty": torch.empty(0, 3, dtype=torch.float16),
    }


def tensor_payload(tensor: torch.Tensor) -> bytes:
    """The raw ext payload packb writes for one tensor."""
    code, payload = msgpack.unpackb(packb(tensor), ext_hook=lambda code, data: (code, data))
    assert code == TENSOR_EXT
    return payload


def pack_ext(code: int, payload: bytes) -> bytes:
    """Plain msgpack bytes for an ext value, bypassing the codec's checks."""
    return msgpack.packb(msgpack.ExtType(code, payload))


def header(code: int, shape: tuple[int, ...]) -> bytes:
    """A tensor header laid out as the docstring of fedmq.common.codec.tensors documents."""
    raw = struct.pack(f"<BB6x{len(shape)}Q", code, len(shape), *shape)
    return raw.ljust(-(-len(raw) // 16) * 16, b"\0")


def decode_or_decode_error(data: bytes) -> None:
    """Decode data; a DecodeError is fine, any other exception fails the test."""
    with contextlib.suppress(DecodeError):
        unpackb(data)
