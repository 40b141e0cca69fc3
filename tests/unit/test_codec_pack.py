"""Tests for fedmq.common.codec's msgpack layer: structures, ext framing, packing errors, bad input."""

from __future__ import annotations

import struct
import subprocess
import sys
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmq.common.codec import TENSOR_EXT, encode_state, packb, unpackb
from fedmq.common.errors import DecodeError
from tests.unit.codec_support import (
    FUZZ,
    REPO_ROOT,
    assert_same_structure,
    assert_same_tensor,
    decode_or_decode_error,
    small_state,
    structures,
    tensor_payload,
)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


# Round trips


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=structures)
def test_nested_structures_round_trip(obj: Any) -> None:
    assert_same_structure(unpackb(packb(obj)), obj)


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary(),
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(st.text() | st.integers(0, 9), inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(obj=plain)
def test_data_without_tensors_packs_to_msgpacks_own_bytes(obj: Any) -> None:
    # The writer hands whole maps and lists of plain values to msgpack's C loop and walks the rest:
    # either way the bytes are msgpack's.
    assert packb(obj) == msgpack.packb(obj, use_bin_type=True)


def test_tuples_come_back_as_lists() -> None:
    assert unpackb(packb({"pair": (1, (2, "x"))})) == {"pair": [1, [2, "x"]]}


def test_packing_plain_data_does_not_import_torch() -> None:
    script = (
        "import sys; from fedmq.common import codec;"
        "obj = {'a': [1, 2.0, 'x', b'y'], 7: None};"
        "assert codec.unpackb(codec.packb(obj)) == obj;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True, timeout=60)


# Ext framing


@pytest.mark.parametrize("size", [239, 240, 65519, 65520, 70000])
def test_payloads_on_each_ext_length_boundary_round_trip(size: int) -> None:
    tensor = torch.arange(size, dtype=torch.int64).to(torch.uint8)
    assert_same_tensor(unpackb(packb(tensor)), tensor)


def test_sixteen_byte_payloads_use_msgpack_fixext() -> None:
    encoded = packb(torch.empty(0))
    assert encoded[:2] == bytes([0xD8, TENSOR_EXT])
    assert len(encoded) == 18


# Packing errors


@pytest.mark.parametrize("obj", [{1, 2}, object(), 1j, [frozenset()], {"a": {"b": object()}}])
def test_packing_an_unsupported_type_raises_type_error(obj: Any) -> None:
    with pytest.raises(TypeError):
        packb(obj)


@pytest.mark.parametrize("key", [(1, 2), True, 1.5, None, b"raw"])
def test_packing_a_map_key_that_is_not_str_or_int_raises_type_error(key: Any) -> None:
    with pytest.raises(TypeError):
        packb({"outer": {key: 1}})


def test_packing_nesting_deeper_than_msgpack_can_read_raises_value_error() -> None:
    obj: Any = 0
    for _ in range(600):
        obj = [obj, None]
    with pytest.raises(ValueError):
        packb(obj)


# Malformed input


def test_extra_trailing_bytes_raise_decode_error() -> None:
    with pytest.raises(DecodeError, match="ExtraData"):
        unpackb(encode_state(small_state()) + b"\x00")


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
