"""Tests for fedmq.common.codec: round trips, the wire layout, malformed input and state digests."""

from __future__ import annotations

import contextlib
import math
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmq.common import codec
from fedmq.common.codec import (
    DEFAULT_MAX_BYTES,
    TENSOR_EXT,
    decode_state,
    encode_state,
    packb,
    state_digest,
    unpackb,
)
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
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
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
    """A tensor header laid out as the codec's docstring documents."""
    raw = struct.pack(f"<BB6x{len(shape)}Q", code, len(shape), *shape)
    return raw.ljust(-(-len(raw) // 16) * 16, b"\0")


def decode_or_decode_error(data: bytes) -> None:
    """Decode data; a DecodeError is fine, any other exception fails the test."""
    with contextlib.suppress(DecodeError):
        unpackb(data)


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


@pytest.mark.parametrize("size", [239, 240, 65519, 65520, 70000])
def test_payloads_on_each_ext_length_boundary_round_trip(size: int) -> None:
    tensor = torch.arange(size, dtype=torch.int64).to(torch.uint8)
    assert_same_tensor(unpackb(packb(tensor)), tensor)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=structures)
def test_nested_structures_round_trip(obj: Any) -> None:
    assert_same_structure(unpackb(packb(obj)), obj)


def test_tuples_come_back_as_lists() -> None:
    assert unpackb(packb({"pair": (1, (2, "x"))})) == {"pair": [1, [2, "x"]]}


def test_state_round_trips_in_its_original_order() -> None:
    state = small_state()
    decoded = decode_state(encode_state(state))
    assert list(decoded) == list(state)
    for name, tensor in state.items():
        assert_same_tensor(decoded[name], tensor)


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


def test_packing_plain_data_does_not_import_torch() -> None:
    script = (
        "import sys; from common import codec;"
        "obj = {'a': [1, 2.0, 'x', b'y'], 7: None};"
        "assert codec.unpackb(codec.packb(obj)) == obj;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True, timeout=60)


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


def test_sixteen_byte_payloads_use_msgpack_fixext() -> None:
    encoded = packb(torch.empty(0))
    assert encoded[:2] == bytes([0xD8, TENSOR_EXT])
    assert len(encoded) == 18


def test_big_endian_hosts_write_little_endian_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = torch.tensor([1.0, -2.5], dtype=torch.complex64)
    native = tensor_payload(tensor)
    monkeypatch.setattr(codec, "_LITTLE_ENDIAN", False)
    swapped = tensor_payload(tensor)
    start = len(header(15, (2,)))
    parts = [native[i : i + 4] for i in range(start, len(native), 4)]
    assert swapped == native[:start] + b"".join(part[::-1] for part in parts)
    assert_same_tensor(unpackb(packb(tensor)), tensor)


# Packing errors


@pytest.mark.parametrize("obj", [{1, 2}, object(), 1j, [frozenset()], {"a": {"b": object()}}])
def test_packing_an_unsupported_type_raises_type_error(obj: Any) -> None:
    with pytest.raises(TypeError):
        packb(obj)


@pytest.mark.parametrize("key", [(1, 2), True, 1.5, None, b"raw"])
def test_packing_a_map_key_that_is_not_str_or_int_raises_type_error(key: Any) -> None:
    with pytest.raises(TypeError):
        packb({"outer": {key: 1}})


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


def test_packing_nesting_deeper_than_msgpack_can_read_raises_value_error() -> None:
    obj: Any = 0
    for _ in range(600):
        obj = [obj, None]
    with pytest.raises(ValueError):
        packb(obj)


@pytest.mark.parametrize("state", [{"w": [1.0]}, {1: torch.ones(1)}])
def test_encoding_a_state_that_is_not_names_to_tensors_raises_type_error(state: Any) -> None:
    with pytest.raises(TypeError):
        encode_state(state)


# Malformed input


def test_truncated_input_raises_decode_error() -> None:
    encoded = encode_state(small_state())
    for end in range(len(encoded)):
        with pytest.raises(DecodeError):
            decode_state(encoded[:end])


def test_extra_trailing_bytes_raise_decode_error() -> None:
    with pytest.raises(DecodeError, match="ExtraData"):
        unpackb(encode_state(small_state()) + b"\x00")


def test_input_over_max_bytes_raises_decode_error_before_unpacking() -> None:
    encoded = encode_state(small_state())
    assert decode_state(encoded, max_bytes=len(encoded))
    with pytest.raises(DecodeError, match="exceeds limit"):
        decode_state(encoded, max_bytes=len(encoded) - 1)
    assert DEFAULT_MAX_BYTES == 2 * 1024**3


@pytest.mark.parametrize("data", ["text", None, 12, [1]])
def test_input_that_is_not_bytes_raises_decode_error(data: Any) -> None:
    with pytest.raises(DecodeError, match="expected bytes"):
        unpackb(data)


def test_bytearray_and_memoryview_inputs_are_accepted() -> None:
    encoded = packb({"a": torch.ones(2)})
    for data in (bytearray(encoded), memoryview(encoded)):
        assert_same_tensor(unpackb(data)["a"], torch.ones(2))
    words = memoryview(bytearray(b"\x93\x01\x02\x03")).cast("I")
    assert unpackb(words) == [1, 2, 3]


def test_unreadable_memoryviews_raise_decode_error() -> None:
    with pytest.raises(DecodeError):
        unpackb(memoryview(b"\x92\x01\x02\xc0")[::2])
    released = memoryview(b"\x01")
    released.release()
    with pytest.raises(DecodeError):
        unpackb(released)


@pytest.mark.parametrize("code", [0, 2, 5, 127, -5, -128])
def test_unknown_ext_code_raises_decode_error(code: int) -> None:
    payload = tensor_payload(torch.ones(2))
    data = b"\x92\x01\xc7" + struct.pack("Bb", len(payload), code) + payload
    with pytest.raises(DecodeError, match="ext type"):
        unpackb(data)


@pytest.mark.parametrize(
    "data",
    [
        b"\xd6\xff" + bytes(4),
        b"\x91\xd6\xff" + bytes(4),
        b"\x81\xa1a\xd6\xff" + bytes(4),
        b"\xd7\xff" + bytes(8),
        b"\xc7\x03\xff" + bytes(3),
    ],
    ids=["top-level", "in-array", "in-map", "timestamp64", "bad-length"],
)
def test_msgpack_timestamps_raise_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        unpackb(data)


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


@pytest.mark.parametrize(
    "data",
    [
        b"\x81\xc4\x01k\x01",  # bytes key
        b"\x81\xcb" + struct.pack(">d", 1.5) + b"\x01",  # float key
        b"\x81\xc0\x01",  # nil key
        b"\x81\xc3\x01",  # bool key
        b"\x81\x91\x01\x01",  # array key
        b"\x81\x80\x01",  # map key
        b"\x82\xa1a\x01\xa1a\x02",  # duplicate key
    ],
    ids=["bytes", "float", "nil", "bool", "array", "map", "duplicate"],
)
def test_map_keys_other_than_unique_str_or_int_raise_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError, match="key"):
        unpackb(data)


def test_str_and_int_map_keys_decode() -> None:
    assert unpackb(b"\x82\xa1a\x01\x07\x02") == {"a": 1, 7: 2}


@pytest.mark.parametrize(
    "data",
    [
        b"\xa2\xff\xfe",  # invalid UTF-8
        b"\xc1",  # reserved format byte
        b"\xdd\xff\xff\xff\xff",  # array claiming 4 billion items
        b"\xdf\xff\xff\xff\xff",  # map claiming 4 billion entries
        b"\xc6\xff\xff\xff\xff",  # bin claiming 4 GiB
        b"\x91" * 2000 + b"\x00",  # nested deeper than msgpack allows
        b"",
    ],
    ids=["utf8", "reserved", "huge-array", "huge-map", "huge-bin", "deep", "empty"],
)
def test_malformed_msgpack_raises_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        unpackb(data)


@pytest.mark.parametrize(
    "data",
    [packb([torch.ones(1)]), packb({"w": 1.0}), packb({3: torch.ones(1)}), packb(None)],
    ids=["list", "non-tensor-value", "int-name", "nil"],
)
def test_decoding_a_state_that_is_not_names_to_tensors_raises_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError, match="state"):
        decode_state(data)


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_decode_or_raise_only_decode_error(data: bytes) -> None:
    decode_or_decode_error(data)


VALID = packb({"round": 3, "state": small_state(), "meta": ["x", 1.5, None, b"\x00"]})


@pytest.mark.slow  # a fuzzer: seconds
@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255), st.sampled_from("sid")),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_valid_encodings_decode_or_raise_only_decode_error(
    edits: list[tuple[int, int, str]],
) -> None:
    data = bytearray(VALID)
    for position, value, kind in edits:
        position %= len(data) or 1
        if kind == "s" and data:
            data[position] = value
        elif kind == "i":
            data.insert(position, value)
        elif data:
            del data[position]
    decode_or_decode_error(bytes(data))


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


# State digest


def test_state_digest_is_hex_sha256_and_ignores_insertion_order() -> None:
    state = small_state()
    reordered = dict(reversed(list(state.items())))
    assert state_digest(state) == state_digest(reordered)
    assert len(state_digest(state)) == 64
    int(state_digest(state), 16)


def test_state_digest_survives_an_encode_decode_round_trip() -> None:
    state = small_state()
    assert state_digest(decode_state(encode_state(state))) == state_digest(state)


def test_state_digest_depends_on_values_not_memory_layout() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    assert state_digest({"w": base.t()}) == state_digest({"w": base.t().contiguous()})


@settings(max_examples=100, deadline=None)
@given(tensor=tensors().filter(lambda t: t.numel() > 0 and t.dtype != torch.bool), data=st.data())
def test_state_digest_changes_when_a_single_bit_flips(tensor: torch.Tensor, data: Any) -> None:
    raw = bytearray(bits(tensor).numpy().tobytes())
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    flipped = tensor_from_bytes(bytes(raw), tensor.dtype, tuple(tensor.shape))
    assert state_digest({"w": tensor}) != state_digest({"w": flipped})


def test_state_digest_changes_when_a_bool_flips() -> None:
    assert state_digest({"m": torch.tensor([True])}) != state_digest({"m": torch.tensor([False])})


def test_state_digest_changes_with_dtype_shape_or_name() -> None:
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    digest = state_digest({"w": base})
    assert digest != state_digest({"w": base.view(torch.int32)})
    assert digest != state_digest({"w": base.reshape(3, 2)})
    assert digest != state_digest({"v": base})
    assert digest != state_digest({"w": base, "v": base})
    assert state_digest({"ab": base, "c": base}) != state_digest({"a": base, "bc": base})
