"""Compressed updates between learner and aggregator: the spec section, the delta's round trip, and the
aggregator's checks of hostile compressed payloads (common/codec/updates.py, aggregator validation)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedmq.common.codec.compress import CompressionSpec, Residual
from fedmq.common.codec.updates import (
    RESIDUAL,
    RESIDUAL_SCALE,
    RestoredWeights,
    Without,
    compress_update,
    decode_update,
    split_residual,
    with_prefix,
)
from fedmq.common.errors import ConfigError, ValidationError
from fedmq.common.messages import ClientUpdate, from_wire, to_wire
from fedmq.services.aggregator.validation import check_update
from fedmq.services.learner.work import compressed
from tests.conftest import assert_bit_identical, small_job

INT8 = CompressionSpec(codec="int8")
TOPK = CompressionSpec(codec="topk", fraction=0.25)
TOPK_PLAIN = CompressionSpec(codec="topk", fraction=0.25, error_feedback=False)
TOPK_BF16 = CompressionSpec(codec="topk", fraction=0.25, residual="bfloat16")
TOPK_F16 = CompressionSpec(codec="topk", fraction=0.25, residual="float16")
TOPK_INT8 = CompressionSpec(codec="topk", fraction=0.25, residual="int8")
TOPK_OPTIONS = [TOPK, TOPK_PLAIN, TOPK_BF16, TOPK_F16, TOPK_INT8]


def option_id(spec: CompressionSpec) -> str:
    return "no-feedback" if not spec.error_feedback else f"residual-{spec.residual}"


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 4, generator=g),
        "b": torch.randn(8, generator=g),
        "steps": torch.tensor(7, dtype=torch.int64),  # an integer buffer: travels as its value
    }


def trained(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 3
            for k, v in base.items()}


def update(**changes: Any) -> ClientUpdate:
    fields: dict[str, Any] = dict(job_id="j", task_id="t", round=1, client=0, base_digest="d",
                                  num_examples=10, weights={})
    return ClientUpdate(**(fields | changes))


def compressed_update(spec: CompressionSpec, residual: Residual | None = None) -> ClientUpdate:
    base = model()
    plain = update(weights=trained(base))
    return compressed(plain, base, spec, residual)


def test_a_spec_names_its_codec_in_full_or_alone_and_defaults_to_none() -> None:
    assert small_job().compression == CompressionSpec()
    assert small_job(compression="int8").compression == INT8
    assert small_job(compression={"codec": "topk", "fraction": 0.25}).compression == TOPK
    with pytest.raises(ConfigError, match="codec topk needs a fraction"):
        small_job(compression={"codec": "topk"})
    with pytest.raises(ConfigError, match=r"compression.codec"):
        small_job(compression="int4")
    raw = {"codec": "topk", "fraction": 0.25, "residual": "int8"}
    assert small_job(compression=raw).compression == TOPK_INT8
    assert TOPK.error_feedback and TOPK.residual == "float32", "the defaults: today's behaviour"
    for spec in [INT8, *TOPK_OPTIONS]:  # a stored spec (all fields written out) reads back the same
        assert small_job(compression=spec.model_dump()).compression == spec


def test_an_uncompressed_job_sends_its_weights_as_they_are() -> None:
    base = model()
    plain = update(weights=trained(base))
    assert compressed(plain, base, CompressionSpec(), None) is plain


@pytest.mark.parametrize("spec", [INT8, CompressionSpec(codec="float16"), TOPK], ids=lambda s: s.codec)
def test_a_compressed_update_decodes_to_global_plus_its_delta_whole_or_one_tensor_at_a_time(
    spec: CompressionSpec,
) -> None:
    base, new = model(), trained(model())
    sent = from_wire(to_wire(compressed(update(weights=new), base, spec, None)))
    assert isinstance(sent, ClientUpdate) and sent.weights == {}
    whole = decode_update(sent.delta, sent.compression, base)
    lazy = RestoredWeights(base, sent.delta, sent.compression)
    assert list(lazy) == list(base)
    assert_bit_identical(dict(lazy), whole)
    assert torch.equal(whole["steps"], new["steps"]), "integer buffers travel exactly"
    scale = (new["w"] - base["w"]).abs().max() / 127
    if spec.codec == "int8":
        assert (whole["w"] - new["w"]).abs().max() <= scale / 2 + 1e-6
    if spec.codec == "topk":
        kept = (whole["w"] != base["w"]).sum().item()
        assert kept == 8, "a quarter of the 32 entries"


def test_topk_sends_its_new_residual_in_the_extras_under_fedmqs_prefix_and_takes_the_old_one_back() -> None:
    first = compressed_update(TOPK)
    _, residual = split_residual(first.extras)
    assert set(first.extras) == {RESIDUAL + "w", RESIDUAL + "b"}
    assert set(residual.values) == {"w", "b"} and residual.scales == {}
    assert all(bool(r.abs().sum() > 0) for r in residual.values.values())
    again = compressed_update(TOPK, residual)
    encoded, expected = compress_update(trained(model()), model(), TOPK, residual)
    assert expected is not None
    assert_bit_identical(split_residual(again.extras)[1].values, expected.values)
    assert_bit_identical(dict(again.delta), encoded.tensors)


@pytest.mark.parametrize("spec", TOPK_OPTIONS, ids=option_id)
def test_each_topk_option_survives_the_wire_passes_the_checks_and_takes_its_residual_back(
    spec: CompressionSpec,
) -> None:
    first = from_wire(to_wire(compressed_update(spec)))
    assert isinstance(first, ClientUpdate)
    check_update(first, model(), compression=spec)
    _, residual = split_residual(first.extras)
    if not spec.error_feedback:
        assert first.extras == {}, "plain top-k sends no residual"
        return
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "int8": torch.int8}[spec.residual]
    assert {t.dtype for t in residual.values.values()} == {dtype}
    assert set(residual.scales) == ({"w", "b"} if spec.residual == "int8" else set())
    # What the aggregator keeps and hands back is exactly what was sent; the learner dequantizes it.
    again = from_wire(to_wire(compressed_update(spec, residual)))
    assert isinstance(again, ClientUpdate)
    check_update(again, model(), compression=spec)
    encoded, expected = compress_update(trained(model()), model(), spec, residual)
    assert expected is not None
    assert_bit_identical(dict(again.extras), with_prefix(expected))
    assert_bit_identical(dict(again.delta), encoded.tensors)
    assert not all(torch.equal(a, b) for a, b in zip(first.delta.values(), again.delta.values(), strict=True))


def test_reduced_residuals_carry_fewer_bytes_and_plain_topk_none() -> None:
    sizes = {option_id(s): split_residual(compressed_update(s).extras)[1].nbytes() for s in TOPK_OPTIONS}
    floats = (8 * 4 + 8) * 4
    assert sizes == {"residual-float32": floats, "no-feedback": 0, "residual-bfloat16": floats // 2,
                     "residual-float16": floats // 2, "residual-int8": floats // 4 + 2 * 4}


def test_a_tasks_extras_may_not_use_fedmqs_residual_prefix() -> None:
    base = model()
    plain = update(weights=trained(base), extras={RESIDUAL + "w": torch.zeros(1)})
    with pytest.raises(Exception, match="fedmq's own"):
        compressed(plain, base, TOPK, None)


def test_a_strategy_sees_the_extras_without_the_residual() -> None:
    extras = {"count": torch.ones(1)} | with_prefix(Residual({"w": torch.zeros(2)}, {}))
    seen = Without(extras)
    assert list(seen) == ["count"] and len(seen) == 1
    with pytest.raises(KeyError):
        seen[RESIDUAL + "w"]


def test_sound_compressed_updates_pass_the_aggregators_checks() -> None:
    check_update(compressed_update(INT8), model(), compression=INT8)
    check_update(compressed_update(TOPK), model(), compression=TOPK)


def _nan_scale(u: ClientUpdate) -> dict[str, Any]:
    return {"delta": {**u.delta, "0.scale": torch.tensor(float("nan"))}}


def _bad_index(u: ClientUpdate) -> dict[str, Any]:
    return {"delta": {**u.delta, "0.indices": torch.tensor([0, 1, 2, 99, 4, 5, 6, 7], dtype=torch.int32)}}


def _huge_shape(u: ClientUpdate) -> dict[str, Any]:
    meta = dict(u.compression or {})
    meta["tensors"] = [["w", "float32", [2**40, 2**20]], *meta["tensors"][1:]]
    return {"compression": meta}


def _short_residual(u: ClientUpdate) -> dict[str, Any]:
    return {"extras": {**u.extras, RESIDUAL + "w": torch.zeros(3)}}


def _as(dtype: torch.dtype) -> Any:
    return lambda u: {"extras": {k: v.to(dtype) if k.startswith(RESIDUAL) else v
                                 for k, v in u.extras.items()}}


def _without_scale(u: ClientUpdate) -> dict[str, Any]:
    return {"extras": {k: v for k, v in u.extras.items() if k != RESIDUAL_SCALE + "w"}}


def _scale(value: float) -> Any:
    return lambda u: {"extras": {**u.extras, RESIDUAL_SCALE + "w": torch.tensor(value)}}


def _q_min(u: ClientUpdate) -> dict[str, Any]:
    return {"extras": {**u.extras, RESIDUAL + "w": torch.full((8, 4), -128, dtype=torch.int8)}}


def _inf_float16(u: ClientUpdate) -> dict[str, Any]:
    return {"delta": {**u.delta, "0.data": torch.full((8, 4), float("inf"), dtype=torch.float16)}}


@pytest.mark.parametrize(
    ("spec", "job", "change", "reason"),
    [
        (INT8, INT8, _nan_scale, "bad_compression"),
        (INT8, INT8, lambda u: {"delta": {k: v for k, v in u.delta.items() if k != "1.q"}},
         "bad_compression"),
        (INT8, INT8, lambda u: {"delta": {**u.delta, "0.q": torch.zeros(4, 8, dtype=torch.int8)}},
         "bad_compression"),
        (INT8, INT8, _huge_shape, "bad_compression"),
        (INT8, INT8, lambda u: {"compression": {"codec": "int8"}}, "bad_compression"),
        (INT8, INT8, lambda u: {"compression": None}, "bad_compression"),
        (INT8, INT8, lambda u: {"weights": model()}, "bad_compression"),
        (INT8, TOPK, lambda u: {}, "bad_compression"),  # another codec than the job's
        (INT8, CompressionSpec(), lambda u: {}, "bad_compression"),  # the job does not compress
        (INT8, INT8, lambda u: {"extras": with_prefix(Residual({"w": torch.zeros(8, 4)}, {}))},
         "bad_compression"),
        (TOPK, TOPK, _bad_index, "bad_compression"),
        (TOPK, TOPK, _short_residual, "bad_compression"),
        (TOPK, TOPK, lambda u: {"extras": {k: v for k, v in u.extras.items() if not k.endswith(".b")}},
         "bad_compression"),
        (TOPK, TOPK, lambda u: {"extras": {**u.extras, RESIDUAL + "w": torch.full((8, 4), float("nan"))}},
         "non_finite"),
        (CompressionSpec(codec="float16"), CompressionSpec(codec="float16"), _inf_float16, "non_finite"),
        (TOPK, TOPK_PLAIN, lambda u: {}, "bad_compression"),  # a residual the job does not keep
        (TOPK, TOPK_BF16, lambda u: {}, "bad_compression"),  # float32 where bfloat16 is declared
        (TOPK_BF16, TOPK_BF16, _as(torch.float16), "bad_compression"),
        (TOPK_F16, TOPK_F16, _as(torch.bfloat16), "bad_compression"),
        (TOPK_BF16, TOPK, lambda u: {}, "bad_compression"),  # bfloat16 where float32 is declared
        (TOPK_INT8, TOPK_INT8, _as(torch.float32), "bad_compression"),
        (TOPK_INT8, TOPK_INT8, _without_scale, "bad_compression"),
        (TOPK_INT8, TOPK_INT8, _scale(float("nan")), "non_finite"),
        (TOPK_INT8, TOPK_INT8, _scale(-1.0), "bad_compression"),
        (TOPK_INT8, TOPK_INT8, lambda u: {"extras": {**u.extras, RESIDUAL_SCALE + "w": torch.ones(2)}},
         "bad_compression"),
        (TOPK_INT8, TOPK_INT8, _q_min, "bad_compression"),
        (TOPK_BF16, TOPK_INT8, lambda u: {}, "bad_compression"),
        (TOPK_INT8, TOPK_BF16, lambda u: {}, "bad_compression"),  # scales the job does not declare
        (TOPK, TOPK, lambda u: {"extras": {**u.extras, "fedmq.residualx": torch.zeros(1)}},
         "bad_compression"),
        (TOPK_BF16, TOPK_BF16, lambda u: {"extras": {**u.extras, RESIDUAL + "w": torch.full(
            (8, 4), float("inf"), dtype=torch.bfloat16)}}, "non_finite"),
        (TOPK_INT8, TOPK_INT8, _scale(3e38), "bad_compression"),  # 127 x 3e38 is inf in float32
        (TOPK, TOPK, lambda u: {"extras": {**u.extras, RESIDUAL + "w": torch.full((8, 4), 3e38)}},
         "bad_compression"),  # finite, but the next delta + residual overflows
    ],
    ids=["nan-scale", "missing-part", "wrong-part-shape", "huge-declared-shape", "bad-meta", "no-meta",
         "weights-too", "other-codec", "uncompressed-job", "residual-without-topk", "index-out-of-range",
         "residual-wrong-shape", "residual-missing", "residual-nan", "float16-inf",
         "residual-without-feedback", "float32-for-bfloat16", "float16-for-bfloat16", "bfloat16-for-float16",
         "bfloat16-for-float32", "float32-for-int8", "int8-without-scale", "int8-nan-scale",
         "int8-negative-scale", "int8-scale-not-scalar", "int8-q-minus-128", "bfloat16-for-int8",
         "int8-for-bfloat16", "stray-reserved-name", "bfloat16-inf", "int8-scale-overflows",
         "residual-near-float32-max"],
)
def test_a_hostile_compressed_update_is_refused_with_its_reason(
    spec: CompressionSpec, job: CompressionSpec, change: Any, reason: str
) -> None:
    sound = compressed_update(spec)
    hostile = sound.model_copy(update=change(sound))
    with pytest.raises(ValidationError) as err:
        check_update(hostile, model(), compression=job)
    assert err.value.reason == reason


def test_a_compressing_job_refuses_plain_weights() -> None:
    with pytest.raises(ValidationError) as err:
        check_update(update(weights=trained(model())), model(), compression=INT8)
    assert err.value.reason == "bad_compression"
