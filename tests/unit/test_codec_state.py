"""Tests for fedmq.common.codec's state functions: encode_state, decode_state and state_digest."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmq.common.codec import DEFAULT_MAX_BYTES, decode_state, encode_state, packb, state_digest
from fedmq.common.errors import DecodeError
from tests.unit.codec_support import assert_same_tensor, bits, small_state, tensor_from_bytes, tensors

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


# Round trips


def test_state_round_trips_in_its_original_order() -> None:
    state = small_state()
    decoded = decode_state(encode_state(state))
    assert list(decoded) == list(state)
    for name, tensor in state.items():
        assert_same_tensor(decoded[name], tensor)


# Encoding errors


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


def test_input_over_max_bytes_raises_decode_error_before_unpacking() -> None:
    encoded = encode_state(small_state())
    assert decode_state(encoded, max_bytes=len(encoded))
    with pytest.raises(DecodeError, match="exceeds limit"):
        decode_state(encoded, max_bytes=len(encoded) - 1)
    assert DEFAULT_MAX_BYTES == 2 * 1024**3


@pytest.mark.parametrize(
    "data",
    [packb([torch.ones(1)]), packb({"w": 1.0}), packb({3: torch.ones(1)}), packb(None)],
    ids=["list", "non-tensor-value", "int-name", "nil"],
)
def test_decoding_a_state_that_is_not_names_to_tensors_raises_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError, match="state"):
        decode_state(data)


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


def test_state_digest_is_the_same_on_one_thread_or_many(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedmq.common.codec import state as state_module

    monkeypatch.setattr(state_module, "DIGEST_PIECE", 64)  # 3.2 KiB of data: 52 pieces over 3 tensors
    state = {"w": torch.arange(800, dtype=torch.float32), "b": torch.ones(3), "e": torch.empty(0)}
    digests = set()
    for threads in (1, 2, 8):
        monkeypatch.setattr(state_module, "DIGEST_THREADS", threads)
        digests.add(state_digest(state))
    assert len(digests) == 1
    flipped = dict(state, w=state["w"].clone())
    flipped["w"][-1] += 1  # the last piece of the tensor hashed in most pieces
    assert state_digest(flipped) not in digests
