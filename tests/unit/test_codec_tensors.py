"""Tests for fedmq.common.codec's tensor wire format: dtypes and shapes, the layout, corrupt headers."""

from __future__ import annotations

import math
import struct
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmq.common.codec import TENSOR_EXT, decode_state, encode_state, packb, unpackb
from fedmq.common.codec import tensors as tensor_wire
from fedmq.common.errors import DecodeError
from tests.unit.codec_support import (
    DTYPES,
    FUZZ,
    assert_same_tensor,
    decode_or_decode_error,
    header,
    pack_ext,
    tensor_from_bytes,
    tensor_payload,
    tensors,
)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


# Round trips


@settings(max_examples=400, deadline=None)
@given(tensor=tensors())
def test_every_dtype_and_shape_round_trips_bit_for_bit(tensor: torch.Tensor) -> None:
    assert_same_tensor(unpackb(packb(tensor)), tensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (2, 3)], ids=str)
def test_zero_dim_and_empty_tensors_round_trip_for_every_dtype(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    raw = bytes(range(1, 1 + math.prod(shape) * dtype.itemsize))
    tensor = tensor_from_bytes(raw, dtype, shape)
    assert_same_tensor(unpackb(packb(tensor)), tensor)


def test_nan_payloads_negative_zero_and_subnormals_survive_bitwise() -> None:
    words = [0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 0x00000001, 0x7F800000]
    tensor = torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert_same_tensor(unpackb(packb(tensor)), tensor)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4).t(),
        lambda: torch.arange(20, dtype=torch.int16)[3::2],
        lambda: torch.arange(10.0)[4:],
        lambda: torch.nn.Parameter(torch.ones(2, 2)),
        lambda: torch.randn(3, dtype=torch.complex64).conj(),
        lambda: torch.ones(3).neg(),
        lambda: torch.zeros(2, 3).expand(4, 2, 3),
    ],
    ids=["transposed", "strided", "offset", "parameter", "conj", "neg", "expanded"],
)
def test_non_contiguous_and_view_tensors_round_trip_as_their_values(make: Any) -> None:
    tensor = make()
    decoded = unpackb(packb(tensor))
    assert_same_tensor(decoded, tensor.detach().resolve_conj().resolve_neg().contiguous())


def test_decoded_tensors_need_a_clone_before_writing_and_raise_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decoded = decode_state(encode_state({"w": torch.zeros(4)}))
    writable = decoded["w"].clone()
    writable += 1
    assert torch.equal(writable, torch.ones(4))
    assert torch.equal(decoded["w"], torch.zeros(4))


def test_decoded_tensor_data_is_aligned_for_its_dtype() -> None:
    state = {f"t{i}": torch.ones(i + 1, dtype=torch.complex128) for i in range(5)}
    state["odd"] = torch.ones(3, dtype=torch.uint8)
    for tensor in decode_state(encode_state(state)).values():
        assert tensor.data_ptr() % tensor.dtype.itemsize == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_copied_to_cpu_and_round_trip() -> None:
    tensor = torch.arange(10, dtype=torch.float32, device="cuda")
    assert_same_tensor(unpackb(packb(tensor)), tensor.cpu())


# Wire layout


def test_tensor_payload_matches_the_documented_layout() -> None:
    tensor = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    expected = header(12, (2, 3)) + struct.pack("<6f", 1, 2, 3, 4, 5, 6)
    assert tensor_payload(tensor) == expected
    assert len(header(12, (2, 3))) % 16 == 0


def test_big_endian_hosts_write_little_endian_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = torch.tensor([1.0, -2.5], dtype=torch.complex64)
    native = tensor_payload(tensor)
    monkeypatch.setattr(tensor_wire, "_LITTLE_ENDIAN", False)
    swapped = tensor_payload(tensor)
    start = len(header(15, (2,)))
    parts = [native[i : i + 4] for i in range(start, len(native), 4)]
    assert swapped == native[:start] + b"".join(part[::-1] for part in parts)
    assert_same_tensor(unpackb(packb(tensor)), tensor)


# Packing errors


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
        lambda: torch.eye(3).to_sparse(),
    ],
    ids=["quantized", "sparse"],
)
def test_packing_an_unsupported_tensor_kind_raises_type_error(make: Any) -> None:
    with pytest.raises(TypeError):
        packb(make())


# Malformed input


def test_unknown_dtype_codes_raise_decode_error() -> None:
    data = bytes(4)
    for code in (0, 23, 99, 255):
        with pytest.raises(DecodeError, match="dtype code"):
            unpackb(pack_ext(TENSOR_EXT, header(code, (1,)) + data))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x0c",
        header(12, (2,))[:12],
        bytes([12, 1, 0, 0, 0, 0, 0, 0]),
        bytes([12, 65]) + bytes(6) + bytes(8 * 65 + 8),
        bytes([12, 1, 0, 0, 0, 1, 0, 0]) + struct.pack("<Q", 1) + bytes(4),
        header(12, (1, 1))[:-1] + b"\x01" + bytes(4),
        header(12, (3,)) + bytes(8),
        header(12, (2,)) + bytes(12),
        header(12, (2**64 - 1,)) + bytes(4),
        header(12, (2**63,)) + bytes(4),
        header(12, (2**32, 2**32)) + bytes(4),
        header(12, (0, 2**62, 2**62)),
        header(12, ()) + bytes(8),
        header(1, (2,)) + b"\x01\x02",
    ],
    ids=[
        "empty",
        "one-byte",
        "short-header",
        "missing-dims",
        "too-many-dims",
        "reserved-set",
        "padding-set",
        "too-few-data-bytes",
        "too-many-data-bytes",
        "dim-2^64-1",
        "dim-2^63",
        "overflowing-product",
        "zero-but-stride-overflow",
        "zero-dim-with-extra",
        "bool-not-0-or-1",
    ],
)
def test_corrupted_tensor_header_raises_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        unpackb(pack_ext(TENSOR_EXT, payload))


@pytest.mark.slow  # a fuzzer: seconds
@FUZZ
@given(
    code=st.integers(0, 30),
    shape=st.lists(
        st.one_of(st.integers(0, 4), st.integers(0, 2**64 - 1), st.sampled_from([2**63, 2**32])),
        max_size=4,
    ),
    data=st.binary(max_size=64),
    trailing=st.binary(max_size=8),
)
def test_random_tensor_headers_decode_or_raise_only_decode_error(
    code: int, shape: list[int], data: bytes, trailing: bytes
) -> None:
    decode_or_decode_error(pack_ext(TENSOR_EXT, header(code, tuple(shape)) + data) + trailing)
