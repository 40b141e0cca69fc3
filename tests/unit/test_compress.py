"""Update compression codecs, checked against NumPy oracles written from each codec's definition."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmq.common.codec import packb, unpackb
from fedmq.common.codec.compress import (
    CompressionSpec,
    Encoded,
    decode,
    dequantize_residual,
    downlink_bytes,
    downlinked,
    encode,
    encoded_nbytes,
    quantize_residual,
    widened,
)
from fedmq.common.errors import DecodeError, ValidationError
from tests.unit.codec_support import REPO_ROOT, assert_same_tensor

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INT8 = CompressionSpec(codec="int8")
shapes_st = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


def topk(fraction: float) -> CompressionSpec:
    return CompressionSpec(codec="topk", fraction=fraction)


def random_delta(seed: int, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.asarray(rng.standard_normal(shape) * scale)).to(dtype)


def as_f64(tensor: torch.Tensor) -> np.ndarray:
    """float64 NumPy copy (bfloat16 and float16 widen exactly through float32)."""
    return tensor.float().numpy().astype(np.float64) if tensor.dtype != torch.float64 else tensor.numpy()


def round_trip(delta: dict[str, torch.Tensor], spec: CompressionSpec) -> dict[str, torch.Tensor]:
    encoded = encode(delta, spec)
    return decode(encoded.tensors, encoded.meta, delta)


# --- oracles, from the codecs' definitions (not from the module) --------------------------------


def bfloat16_oracle(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32: keep the top 16 bits, rounding to nearest, ties to even."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return np.asarray(rounded.astype(np.uint32).view(np.float32))


def int8_oracle(x: np.ndarray, work: np.dtype) -> tuple[np.ndarray, np.float32]:
    """Symmetric per-tensor quantisation: s = max|x|/127 (stored float32), q = rint(x/s) in [-127, 127]."""
    x = np.asarray(x, work)
    scale = np.float32(np.abs(x).max() / 127) if x.size else np.float32(0)
    if scale == 0:
        return np.zeros(x.shape, np.int8), scale
    return np.asarray(np.clip(np.rint(x / np.asarray(scale, work)), -127, 127), np.int8), scale


def topk_oracle(x: np.ndarray, fraction: float) -> np.ndarray:
    """Indices of the k largest |x| (k = fraction*n rounded half up, at least 1), lower index on ties."""
    flat = x.reshape(-1)
    k = max(1, min(flat.size, int(np.floor(fraction * flat.size + 0.5)))) if flat.size else 0
    order = np.lexsort((np.arange(flat.size), -np.abs(flat)))  # by |x| descending, then index
    return np.sort(order[:k])


# --- casts --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(FLOATS), shape=shapes_st, seed=st.integers(0, 2**32 - 1))
def test_float16_round_trip_equals_the_numpy_float16_cast(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int
) -> None:
    x = random_delta(seed, shape, dtype, scale=100.0)
    out = round_trip({"w": x}, CompressionSpec(codec="float16"))["w"]
    assert out.dtype == dtype and out.shape == x.shape
    np.testing.assert_array_equal(as_f64(out), as_f64(x).astype(np.float16).astype(np.float64))


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), shape=shapes_st,
       seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_bfloat16_round_trip_rounds_to_nearest_even_on_the_top_16_bits(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int
) -> None:
    x = random_delta(seed, shape, dtype, scale=100.0)
    out = round_trip({"w": x}, CompressionSpec(codec="bfloat16"))["w"]
    assert out.dtype == dtype
    expected = torch.from_numpy(bfloat16_oracle(x.float().numpy())).to(dtype)
    assert torch.equal(out, expected)


def test_bfloat16_of_float64_is_within_half_a_bfloat16_ulp() -> None:
    x = random_delta(3, (1000,), torch.float64)
    out = round_trip({"w": x}, CompressionSpec(codec="bfloat16"))["w"]
    assert out.dtype == torch.float64
    assert np.all(np.abs(out.numpy() - x.numpy()) <= np.abs(x.numpy()) * 2.0**-8)


def test_codec_none_returns_the_delta_bit_for_bit() -> None:
    x = torch.tensor([0.0, -0.0, 1e-40, float("nan"), 3.5])
    out = round_trip({"w": x}, CompressionSpec())["w"]
    assert_same_tensor(out, x)


def test_float16_refuses_a_delta_beyond_its_range_and_names_the_way_out() -> None:
    with pytest.raises(ValidationError, match="overflows float16.*bfloat16"):
        encode({"w": torch.tensor([1.0, 70000.0])}, CompressionSpec(codec="float16"))


# --- int8 ---------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(FLOATS), shape=shapes_st, seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-6, 1.0, 1e4]))  # fmt: skip
def test_int8_matches_the_numpy_quantiser_and_errs_at_most_half_a_step(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, scale: float
) -> None:
    x = random_delta(seed, shape, dtype, scale)
    work = np.dtype(np.float64 if dtype == torch.float64 else np.float32)
    q, s = int8_oracle(as_f64(x), work)

    encoded = encode({"w": x}, INT8)
    out = decode(encoded.tensors, encoded.meta, {"w": x})["w"]

    np.testing.assert_array_equal(encoded.tensors["0.q"].numpy(), q)
    assert encoded.tensors["0.scale"].item() == s
    assert out.dtype == dtype
    expected = torch.from_numpy(np.asarray(q.astype(work) * np.asarray(s, work), work)).to(dtype)
    assert torch.equal(out, expected)
    if dtype in (torch.float32, torch.float64):  # the halves round once more on the way back
        assert np.all(np.abs(as_f64(out) - as_f64(x)) <= float(s) / 2 * (1 + 1e-6))


def test_int8_of_a_zero_tensor_has_scale_zero_and_decodes_to_zeros() -> None:
    x = torch.zeros(3, 4)
    encoded = encode({"w": x}, INT8)
    assert encoded.tensors["0.scale"].item() == 0.0
    assert_same_tensor(decode(encoded.tensors, encoded.meta, {"w": x})["w"], torch.zeros(3, 4))


def test_int8_maps_the_largest_magnitude_to_plus_or_minus_127() -> None:
    encoded = encode({"w": torch.tensor([-4.0, 1.0, 2.0])}, INT8)
    assert encoded.tensors["0.q"].tolist() == [-127, 32, 64]  # 31.75 -> 32, 63.5 -> 64 (ties to even)


# --- top-k --------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(FLOATS), shape=shapes_st, seed=st.integers(0, 2**32 - 1),
       fraction=st.floats(1e-3, 1.0), coarse=st.booleans())  # fmt: skip
def test_topk_keeps_exactly_the_k_largest_magnitudes(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, fraction: float, coarse: bool
) -> None:
    x = random_delta(seed, shape, dtype)
    if coarse:  # few distinct magnitudes, so many ties
        x = x.mul(2).round()
    kept = topk_oracle(as_f64(x), fraction)

    encoded = encode({"w": x}, topk(fraction))
    out = decode(encoded.tensors, encoded.meta, {"w": x})["w"]

    np.testing.assert_array_equal(encoded.tensors["0.indices"].numpy(), kept)
    assert encoded.tensors["0.indices"].dtype == torch.int32
    dense = np.zeros(x.numel())
    dense[kept] = as_f64(x).reshape(-1)[kept].astype(np.float32)  # values travel as float32
    np.testing.assert_array_equal(as_f64(out).reshape(-1), dense)
    assert out.dtype == dtype and out.shape == x.shape


def test_topk_breaks_ties_towards_the_lower_index() -> None:
    x = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 3.0])
    encoded = encode({"w": x}, topk(0.5))
    assert encoded.tensors["0.indices"].tolist() == [1, 2, 4]
    assert encode({"w": torch.ones(10)}, topk(0.3)).tensors["0.indices"].tolist() == [0, 1, 2]


def test_topk_keeps_at_least_one_entry_and_all_of_them_at_fraction_one() -> None:
    x = random_delta(0, (50,), torch.float32)
    assert encode({"w": x}, topk(1e-6)).tensors["0.indices"].numel() == 1
    assert torch.equal(round_trip({"w": x}, topk(1.0))["w"], x)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(FLOATS), shape=shapes_st, seed=st.integers(0, 2**32 - 1),
       fraction=st.floats(0.01, 0.5), rounds=st.integers(1, 8))  # fmt: skip
def test_error_feedback_loses_nothing_the_residual_does_not_hold(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, fraction: float, rounds: int
) -> None:
    deltas = [random_delta(seed + t, shape, dtype) for t in range(rounds)]
    residual: dict[str, torch.Tensor] | None = None
    sent = np.zeros(shape)
    for delta in deltas:
        encoded = encode({"w": delta}, topk(fraction), residual)
        sent += as_f64(decode(encoded.tensors, encoded.meta, {"w": delta})["w"])
        residual = encoded.residual
    assert residual is not None
    total = sum(as_f64(d) for d in deltas)
    # Σ decoded = Σ delta − final residual, up to float32 rounding of the running sums.
    np.testing.assert_allclose(sent, total - as_f64(residual["w"]), rtol=0, atol=1e-5 * rounds * 10)


def test_error_feedback_sends_what_earlier_rounds_held_back() -> None:
    first = encode({"w": torch.tensor([3.0, 1.0, 0.5])}, topk(0.34))
    assert first.residual is not None
    assert first.residual["w"].tolist() == [0.0, 1.0, 0.5]
    second = encode({"w": torch.tensor([0.0, 0.0, 0.2])}, topk(0.34), first.residual)
    assert second.tensors["0.indices"].tolist() == [1]
    assert second.residual is not None and second.residual["w"].tolist() == pytest.approx([0.0, 0.0, 0.7])


def test_a_residual_that_does_not_fit_the_delta_is_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        encode({"w": torch.ones(3)}, topk(0.5), {"w": torch.ones(4)})
    with pytest.raises(ValueError, match="no tensor 'w'"):
        encode({"w": torch.ones(3)}, topk(0.5), {})
    with pytest.raises(ValueError, match="keeps no residual"):
        encode({"w": torch.ones(3)}, INT8, {"w": torch.ones(3)})


# --- the residual as it travels (residual: float32 | bfloat16 | float16 | int8) -------------------


def test_without_error_feedback_topk_keeps_no_residual_and_sends_the_same_entries_on_a_first_round() -> None:
    delta = {"w": random_delta(5, (40,), torch.float32)}
    plain = encode(delta, CompressionSpec(codec="topk", fraction=0.1, error_feedback=False))
    fed_back = encode(delta, topk(0.1))
    assert plain.residual is None and fed_back.residual is not None
    assert_same_tensor(plain.tensors["0.values"], fed_back.tensors["0.values"])
    with pytest.raises(ValueError, match="topk without error feedback keeps no residual"):
        encode(delta, CompressionSpec(codec="topk", fraction=0.1, error_feedback=False), delta)


def test_a_float32_residual_travels_as_encode_returned_it() -> None:
    residual = {"w": random_delta(6, (3, 4), torch.float32), "d": random_delta(7, (5,), torch.float64)}
    sent = quantize_residual(residual, "float32")
    assert sent.scales == {} and all(sent.values[k] is residual[k] for k in residual)
    back = dequantize_residual(sent, residual)
    assert_same_tensor(back["w"], residual["w"])
    assert_same_tensor(back["d"], residual["d"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_cast_residual_comes_back_as_the_numpy_cast_widened_to_float32(dtype: str) -> None:
    r = random_delta(8, (64,), torch.float32, scale=0.01)
    sent = quantize_residual({"w": r}, dtype)  # type: ignore[arg-type]
    assert sent.values["w"].dtype == getattr(torch, dtype) and sent.scales == {}
    back = dequantize_residual(sent, {"w": r})["w"]
    assert back.dtype == torch.float32
    oracle = bfloat16_oracle(r.numpy()) if dtype == "bfloat16" else r.numpy().astype(np.float16)
    np.testing.assert_array_equal(back.numpy(), np.asarray(oracle, np.float32))


def test_an_int8_residual_is_q_and_a_scale_and_comes_back_as_q_times_scale() -> None:
    r = random_delta(9, (7, 3), torch.float32)
    sent = quantize_residual({"w": r}, "int8")
    q, scale = int8_oracle(r.numpy(), np.dtype(np.float32))
    np.testing.assert_array_equal(sent.values["w"].numpy(), q)
    assert sent.scales["w"].dtype == torch.float32 and float(sent.scales["w"]) == float(scale)
    back = dequantize_residual(sent, {"w": r})["w"]
    np.testing.assert_array_equal(back.numpy(), q.astype(np.float32) * scale)
    assert sent.nbytes() == 21 + 4


def test_a_float16_residual_beyond_its_range_is_refused_naming_the_way_out() -> None:
    with pytest.raises(ValidationError, match="use residual bfloat16 or int8"):
        quantize_residual({"w": torch.tensor([1e6])}, "float16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_the_next_residual_is_q_of_delta_plus_the_dequantized_one_minus_what_was_sent(dtype: str) -> None:
    spec = topk(0.25)
    deltas = [random_delta(20 + t, (16,), torch.float32) for t in range(3)]
    sent = None
    for delta in deltas:
        previous = dequantize_residual(sent, {"w": delta}) if sent is not None else None
        encoded = encode({"w": delta}, spec, previous)
        decoded = decode(encoded.tensors, encoded.meta, {"w": delta})["w"]
        assert encoded.residual is not None
        start = delta + (previous["w"] if previous is not None else 0)
        assert_same_tensor(encoded.residual["w"], start - decoded)
        sent = quantize_residual(encoded.residual, dtype)  # type: ignore[arg-type]
        again = quantize_residual(encoded.residual, dtype)  # type: ignore[arg-type]
        assert_same_tensor(sent.values["w"], again.values["w"])  # deterministic


# --- every codec --------------------------------------------------------------------------------

ALL_SPECS = [CompressionSpec(codec=c) for c in ("none", "float16", "bfloat16", "int8")] + [topk(0.1)]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.codec)
def test_integer_buffers_pass_through_unchanged(spec: CompressionSpec) -> None:
    delta = {
        "w": random_delta(0, (4, 5), torch.float32),
        "num_batches_tracked": torch.tensor(7),
        "mask": torch.tensor([True, False]),
        "counts": torch.arange(-3, 3, dtype=torch.int16),
    }
    out = round_trip(delta, spec)
    assert list(out) == list(delta)
    for name in ("num_batches_tracked", "mask", "counts"):
        assert_same_tensor(out[name], delta[name])


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.codec)
def test_encoding_is_bit_reproducible_and_survives_the_msgpack_wire(spec: CompressionSpec) -> None:
    delta = {
        "a.weight": random_delta(1, (30, 7), torch.float32),
        "a.bias": random_delta(2, (7,), torch.float64),
    }
    first, second = encode(delta, spec), encode(delta, spec)
    assert first.meta == second.meta
    assert first.tensors.keys() == second.tensors.keys()
    for key in first.tensors:
        assert_same_tensor(second.tensors[key], first.tensors[key])

    wire = unpackb(packb({"tensors": first.tensors, "meta": first.meta}))
    out = decode(wire["tensors"], wire["meta"], delta)
    for name, tensor in decode(first.tensors, first.meta, delta).items():
        assert_same_tensor(out[name], tensor)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.codec)
def test_empty_and_scalar_tensors_round_trip(spec: CompressionSpec) -> None:
    delta = {"empty": torch.empty(0, 3), "scalar": torch.tensor(-2.5)}
    out = round_trip(delta, spec)
    assert out["empty"].shape == (0, 3)
    assert out["scalar"].shape == () and out["scalar"].item() == pytest.approx(-2.5, rel=1e-2)


@pytest.mark.parametrize("spec", [INT8, topk(0.5)], ids=lambda s: s.codec)
def test_a_non_finite_delta_is_refused_before_it_can_spoil_the_scale_or_the_ranking(
    spec: CompressionSpec,
) -> None:
    with pytest.raises(ValidationError, match="non-finite delta: w"):
        encode({"w": torch.tensor([1.0, float("nan")])}, spec)


def test_int8_cuts_float32_bytes_about_four_times_float16_two_and_topk_by_its_fraction() -> None:
    delta = {f"l{i}": random_delta(i, (256, 256), torch.float32) for i in range(3)}
    baseline = encoded_nbytes(delta)
    assert baseline == 3 * 256 * 256 * 4

    def ratio(spec: CompressionSpec) -> float:
        return baseline / encoded_nbytes(encode(delta, spec).tensors)

    assert ratio(CompressionSpec()) == 1.0
    assert ratio(CompressionSpec(codec="float16")) == 2.0
    assert ratio(CompressionSpec(codec="bfloat16")) == 2.0
    assert 3.99 < ratio(INT8) < 4.0  # one float32 scale per tensor
    assert ratio(topk(0.01)) == pytest.approx(4 / (0.01 * 8), rel=0.01)  # int32 index + float32 value


# --- the spec -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"codec": "topk"}, "topk needs a fraction in \\(0, 1\\]"),
        ({"codec": "topk", "fraction": 0.0}, "greater than 0"),
        ({"codec": "topk", "fraction": 1.5}, "less than or equal to 1"),
        ({"codec": "int8", "fraction": 0.1}, "fraction applies to codec topk only"),
        ({"codec": "zip"}, "'none', 'float16', 'bfloat16', 'int8' or 'topk'"),
        ({"codec": "int8", "bits": 4}, "Extra inputs are not permitted"),
        ({"codec": "int8", "error_feedback": False}, "apply to codec topk only"),
        ({"codec": "none", "residual": "int8"}, "apply to codec topk only"),
        ({"codec": "topk", "fraction": 0.1, "error_feedback": False, "residual": "int8"},
         "residual applies with error_feedback true only"),
        ({"codec": "topk", "fraction": 0.1, "residual": "int4"},
         "'float32', 'bfloat16', 'float16' or 'int8'"),
        ({"codec": "topk", "fraction": 0.1, "error_feedback": "no"}, "valid boolean"),
    ],
)
def test_a_bad_compression_spec_says_what_is_allowed(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        CompressionSpec.model_validate(raw)


def test_the_spec_and_module_do_not_import_torch() -> None:
    script = (
        "import sys; from fedmq.common.codec.compress import CompressionSpec;"
        "CompressionSpec.model_validate({'codec': 'topk', 'fraction': 0.01});"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True, timeout=60)


# --- hostile payloads ---------------------------------------------------------------------------

MODEL = {"w": torch.zeros(4, 5), "n": torch.tensor(0)}
Mutation = Callable[[dict[str, Any], dict[str, Any]], None]


def good(spec: CompressionSpec) -> Encoded:
    delta = {"w": random_delta(0, (4, 5), torch.float32), "n": torch.tensor(3)}
    return encode(delta, spec)


def put(key: Any, value: Any) -> Mutation:
    """Replace (or add) one wire tensor."""
    return lambda tensors, meta: tensors.__setitem__(key, value)


def declare(position: int, field: int, value: Any) -> Mutation:
    """Replace the name (0), dtype (1) or shape (2) that meta declares for one tensor."""
    return lambda tensors, meta: meta["tensors"][position].__setitem__(field, value)


def set_meta(key: str, value: Any) -> Mutation:
    return lambda tensors, meta: meta.__setitem__(key, value)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def first_q_to_minus_128(tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    tensors["0.q"].view(-1)[0] = -128


def twenty_one_entries(tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    tensors["0.indices"], tensors["0.values"] = torch.arange(21, dtype=torch.int32), torch.zeros(21)


F16 = CompressionSpec(codec="float16")
TOP = topk(0.1)  # keeps 2 of the 20 entries of "w"
HOSTILE: list[tuple[str, CompressionSpec, Mutation, str]] = [
    ("index past the end", TOP, put("0.indices", i32(3, 20)), "strictly ascending and in \\[0, 20\\)"),
    ("negative index", TOP, put("0.indices", i32(-1, 3)), "strictly ascending"),
    ("repeated index", TOP, put("0.indices", i32(3, 3)), "strictly ascending"),
    ("float indices", TOP, put("0.indices", torch.tensor([1.0, 2.0])), "int32 or int64"),
    ("more entries than the tensor", topk(1.0), twenty_one_entries, "keeps 21 of 20"),
    ("values of the wrong length", TOP, put("0.values", torch.zeros(3)),
     "values is torch.float32 \\[3\\], expected torch.float32 \\[2\\]"),
    ("NaN scale", INT8, put("0.scale", torch.tensor(float("nan"))), "finite and non-negative"),
    ("infinite scale", INT8, put("0.scale", torch.tensor(float("inf"))), "finite"),
    ("negative scale", INT8, put("0.scale", torch.tensor(-1.0)), "non-negative"),
    ("scale as a vector", INT8, put("0.scale", torch.ones(2)), "scale is torch.float32 \\[2\\]"),
    ("q of -128", INT8, first_q_to_minus_128, "\\[-127, 127\\]"),
    ("q of the wrong shape", INT8, put("0.q", torch.zeros(5, 4, dtype=torch.int8)), "q is torch.int8 .5, 4"),
    ("cast of the wrong dtype", F16, put("0.data", torch.zeros(4, 5)), "expected torch.float16"),
    ("a tensor meta does not list", INT8, put("9.q", torch.zeros(1)), "unexpected \\['9.q'\\]"),
    ("a tensor missing", INT8, lambda t, m: t.pop("0.scale"), "missing \\['0.scale'\\]"),
    ("a non-tensor entry", INT8, put("0.scale", 0.5), "not a tensor"),
    ("a huge declared shape", TOP, declare(0, 2, [2**40]),
     "declared float32 \\[1099511627776\\], the model has float32 \\[4, 5\\]"),
    ("meta shape unlike its tensors", INT8, declare(0, 2, [5, 4]), "the model has"),
    ("meta dtype unlike the model", INT8, declare(0, 1, "float64"), "the model has"),
    ("an alias dtype", INT8, declare(0, 1, "float"), "unknown dtype 'float'"),
    ("a non-dtype torch name", INT8, declare(0, 1, "Tensor"), "unknown dtype"),
    ("a negative dim", INT8, declare(0, 2, [-4, 5]), "non-negative ints"),
    ("a bool dim", INT8, declare(0, 2, [True, 5]), "non-negative ints"),
    ("a repeated name", INT8, declare(1, 0, "w"), "distinct strings"),
    ("an entry that is no triple", INT8, lambda t, m: m["tensors"][0].pop(), "not \\[name"),
    ("an unknown codec", INT8, set_meta("codec", "zip"), "unknown compression codec 'zip'"),
    ("a later format", INT8, set_meta("format", 2), "upgrade fedmq"),
    ("a bool format", INT8, set_meta("format", True), "format True"),
    ("a codec that is no string", INT8, set_meta("codec", ["int8"]), "unknown compression codec"),
    ("a key that is no string", INT8, put(7, torch.zeros(1)), "unexpected \\['7'\\]"),
    ("an extra meta key", INT8, set_meta("x", 1), "exactly the keys"),
    ("a model tensor left out", INT8, lambda t, m: m["tensors"].pop(), "missing \\['n'\\]"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "mutate", "message"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_payload_raises_decode_error_saying_what_is_wrong(
    spec: CompressionSpec, mutate: Mutation, message: str
) -> None:
    encoded = good(spec)
    tensors = {k: v.clone() for k, v in encoded.tensors.items()}
    meta = unpackb(packb(encoded.meta))  # a deep copy, as the wire gives it
    mutate(tensors, meta)
    with pytest.raises(DecodeError, match=message):
        decode(tensors, meta, MODEL)


@pytest.mark.parametrize("meta", [None, [], "int8", {"format": 1, "codec": "int8", "tensors": {}}])
def test_meta_that_is_not_the_documented_map_is_refused(meta: Any) -> None:
    with pytest.raises(DecodeError, match="compression meta"):
        decode({}, meta, MODEL)


def test_the_unmodified_payloads_used_above_decode() -> None:
    for spec in {h[1] for h in HOSTILE}:
        encoded = good(spec)
        assert decode(encoded.tensors, encoded.meta, MODEL).keys() == {"w", "n"}



def test_a_bfloat16_downlink_rounds_each_float_to_nearest_within_its_documented_bound() -> None:
    g = torch.Generator().manual_seed(5)
    model = {
        "w": torch.randn(64, 33, generator=g) * torch.logspace(-30, 30, 33),  # float32's range, normal values
        "d": torch.randn(17, generator=g, dtype=torch.float64),
        "half": torch.randn(9, generator=g).half(),
        "steps": torch.tensor(7),
    }
    down = downlinked(model, "bfloat16")
    assert down["w"].dtype == torch.bfloat16
    assert all(down[n] is model[n] for n in ("d", "half", "steps")), "other tensors as they are, exact"
    back = widened(down, model)
    assert {n: t.dtype for n, t in back.items()} == {n: t.dtype for n, t in model.items()}
    assert widened(down, {**model, "w": model["w"].half()})["w"].dtype == torch.bfloat16, (
        "a model whose dtype is not float32 gets what came, for its own check to refuse")
    for name in ("w",):
        x, y = model[name].double(), back[name].double()
        assert torch.all((x - y).abs() <= 2.0**-8 * x.abs()), name  # the bound the docs give
        assert torch.isfinite(y).all(), "float32's range kept: nothing overflows"
        # Round to nearest: neither bfloat16 neighbour of the value sent is closer.
        bits = down[name].view(torch.int16)
        for step in (1, -1):
            neighbour = (bits + step).view(torch.bfloat16).double()
            assert torch.all((x - y).abs() <= (x - neighbour).abs()), (name, step)
    assert downlinked(model, "none") == model
    assert downlink_bytes(model, "bfloat16") == 2 * 64 * 33 + 8 * 17 + 9 * 2 + 8
    assert downlink_bytes(model, "none") == 4 * 64 * 33 + 8 * 17 + 9 * 2 + 8


def test_downlink_is_a_compression_option_beside_any_codec() -> None:
    assert CompressionSpec.model_validate({"downlink": "bfloat16"}).codec == "none"
    assert CompressionSpec.model_validate({"codec": "int8", "downlink": "bfloat16"}).downlink == "bfloat16"
    with pytest.raises(pydantic.ValidationError, match="downlink"):
        CompressionSpec.model_validate({"downlink": "float16"})
