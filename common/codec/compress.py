"""Update compression: codecs for a client's update delta (its weights minus the round's global weights).

The learner encodes, the aggregator decodes. Only float16, bfloat16, float32 and float64 tensors
are compressed; every other tensor (integer buffers, bool, complex) travels unchanged.

    none      the delta as it is
    float16   cast to float16 (bfloat16 likewise); decoded back to the original dtype
    bfloat16
    int8      s = max|x| / 127 per tensor (float32; 0 for a zero tensor), q = round(x / s)
              (to nearest, ties to even); decoded x = q * s, so |error| <= s / 2
    topk      the k = max(1, round(fraction * n)) largest |x| of each tensor (lower index first
              on ties) as ascending indices (int32 below 2**31 entries) and float32 values, with
              error feedback (Seide et al. 2014, Stich et al. 2018): encode compresses
              delta + residual and returns residual' = (delta + residual) - decoded, which the
              client's next round adds back, so nothing is lost, only delayed
              (`error_feedback: false`: plain top-k, no residual at all).

topk's residual travels too (learners keep no state), in the spec's `residual` dtype:
``float32`` (float64 for a float64 tensor) as encode returns it, ``bfloat16``/``float16`` cast,
or ``int8`` with the per-tensor scale above. quantize_residual is that Q: the learner sends
Q(delta + residual_t - decoded) and gets exactly that back next round, dequantized, as
residual_{t+1}, so learner and aggregator agree bit for bit.

Downlink (`downlink: bfloat16`): the global model a learner fetches has its float32 tensors rounded
to bfloat16 on the wire (round to nearest even: each value within 2**-8 of its own magnitude, for
normal values; float32's range kept, so nothing overflows) and widened back on arrival; the learner
trains from those values, in the engine as on the services. The aggregator keeps and folds the
exact model, and counts every update as that model plus what its client changed: a delta is the
trained weights minus the rounded model, and weights sent whole get the rounding error back
(codec.updates.Rebased), so no strategy sees it as part of a client's update.

The encoded form is a flat ``{key: tensor}`` map for the msgpack tensor codec plus plain
metadata: ``{"format": 1, "codec": name, "tensors": [[name, dtype, shape], ...]}``. Keys are
``"<i>.<part>"`` with ``i`` the tensor's position in ``meta["tensors"]``: part ``data`` (none,
casts, and tensors not compressed), ``q`` and ``scale`` (int8), ``indices`` and ``values``
(topk). Decoding checks every key, dtype, shape, scale and index before it allocates, and
allocates no more than the declared shapes, which must be those of ``expected`` (the
round's global weights). Tensors in, tensors out: no I/O.
torch is imported lazily, so the scheduler can validate a CompressionSpec without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedmq.common.errors import DecodeError, ValidationError

if TYPE_CHECKING:
    import torch

FORMAT = 1
Codec = Literal["none", "float16", "bfloat16", "int8", "topk"]
Downlink = Literal["none", "bfloat16"]
ResidualDtype = Literal["float32", "bfloat16", "float16", "int8"]
COMPRESSED_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT8_LEVELS = 127
_PARTS: dict[str, tuple[str, ...]] = {
    "none": ("data",),
    "float16": ("data",),
    "bfloat16": ("data",),
    "int8": ("q", "scale"),
    "topk": ("indices", "values"),
}


class CompressionSpec(BaseModel):
    """How a learner compresses its update: `{codec: int8}` or `{codec: topk, fraction: 0.01}`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    codec: Codec = "none"
    fraction: float | None = Field(
        None, gt=0, le=1, description="topk only: share of each tensor's entries kept, in (0, 1]"
    )
    error_feedback: bool = Field(
        True, description="topk only: carry what top-k held back into the client's next round (a residual)"
    )
    residual: ResidualDtype = Field(
        "float32", description="topk with error feedback: the residual's dtype as it travels"
    )
    downlink: Downlink = Field(
        "none", description="the global model as learners fetch it: none (exact) or bfloat16 (its float32 "
        "tensors in half the bytes, each value within 2**-8 of its magnitude; the learners train from it)"
    )

    @model_validator(mode="after")
    def _fraction_with_topk(self) -> CompressionSpec:
        if self.codec == "topk" and self.fraction is None:
            raise ValueError("codec topk needs a fraction in (0, 1], e.g. {codec: topk, fraction: 0.01}")
        if self.codec != "topk" and self.fraction is not None:
            raise ValueError(f"fraction applies to codec topk only, not {self.codec}: remove it")
        if self.codec != "topk" and (not self.error_feedback or self.residual != "float32"):
            raise ValueError(
                f"error_feedback and residual apply to codec topk only, not {self.codec}: remove them"
            )
        if not self.error_feedback and self.residual != "float32":
            raise ValueError("residual applies with error_feedback true only: no residual travels without it")
        return self

    @property
    def keeps_residual(self) -> bool:
        """Whether each client has an error-feedback residual (topk with error_feedback)."""
        return self.codec == "topk" and self.error_feedback


@dataclass(frozen=True)
class Residual:
    """topk's residual as it travels: values in the spec's residual dtype (int8: q), int8's scales."""

    values: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor]  # name -> float32 scalar; int8 only, else empty

    def nbytes(self) -> int:
        """Tensor data bytes of the residual."""
        return encoded_nbytes(self.values) + encoded_nbytes(self.scales)


@dataclass(frozen=True)
class Encoded:
    """An encoded delta: tensors for the wire, plain metadata, and topk's new residual (else None)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    residual: dict[str, torch.Tensor] | None


def downlinked(weights: Mapping[str, torch.Tensor], downlink: Downlink) -> dict[str, torch.Tensor]:
    """The model as it goes down to learners: float32 tensors rounded to `downlink`'s dtype (none:
    the same tensors), every other tensor as it is (float64's range and precision are not
    bfloat16's to round: they go exact)."""
    import torch

    if downlink == "none":
        return dict(weights)
    return {name: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for name, t in weights.items()}


def rounding_error(exact: torch.Tensor, downlink: Downlink) -> torch.Tensor | None:
    """What the downlink's rounding took from a tensor of the exact model (exact minus its rounded
    value: exactly representable in float32, the two being so close); None if not rounded."""
    import torch

    if downlink == "none" or exact.dtype != torch.float32:
        return None
    return exact - exact.to(torch.bfloat16).float()


def widened(weights: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A downlinked model back in float32 where `like` (the learner's model) is: the rounded values,
    exactly. Any other tensor as it came, for the model's own checks (a dtype that does not match
    is refused there, as without a downlink)."""
    return {name: t.float() if widens(t.dtype, like.get(name, t).dtype) else t for name, t in weights.items()}


def widens(sent: torch.dtype, model: torch.dtype) -> bool:
    """Whether a downlinked tensor that came as `sent` goes back to float32 (its model's `model`)."""
    import torch

    return sent == torch.bfloat16 and model == torch.float32


def downlink_bytes(weights: Mapping[str, torch.Tensor], downlink: Downlink) -> int:
    """Tensor data bytes of the model as one learner receives it."""
    import torch

    narrow = downlink != "none"
    return sum(t.numel() * (2 if narrow and t.dtype == torch.float32 else t.element_size())
               for t in weights.values())


def topk_count(numel: int, fraction: float) -> int:
    """Entries topk keeps of a numel-entry tensor: fraction * numel rounded, at least 1 (0 if empty)."""
    if numel == 0:
        return 0
    return max(1, min(numel, math.floor(fraction * numel + 0.5)))


def encoded_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Tensor data bytes of an encoded delta (the msgpack framing adds a few dozen bytes per tensor)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def encode(
    delta: Mapping[str, torch.Tensor],
    spec: CompressionSpec,
    residual: Mapping[str, torch.Tensor] | None = None,
) -> Encoded:
    """Compress a delta with spec's codec; topk first adds residual (None: zeros) and returns the new one.

    The new residual is in the work dtype (float32; float64 for float64); quantize_residual puts it
    in the spec's residual dtype. Without error feedback there is none.
    """
    if residual is not None and not spec.keeps_residual:
        raise ValueError(f"{_what(spec)} keeps no residual; pass residual=None")
    tensors: dict[str, torch.Tensor] = {}
    entries: list[list[Any]] = []
    new_residual: dict[str, torch.Tensor] | None = {} if spec.keeps_residual else None
    for i, (name, x) in enumerate(delta.items()):
        dtype = _dtype_name(x)
        entries.append([name, dtype, list(x.shape)])
        if dtype not in COMPRESSED_DTYPES:
            tensors[f"{i}.data"] = x
            continue
        if spec.codec in ("none", "float16", "bfloat16"):
            tensors[f"{i}.data"] = _cast(name, x, spec.codec)
        elif spec.codec == "int8":
            tensors[f"{i}.q"], tensors[f"{i}.scale"] = _int8(name, x)
        else:
            assert spec.fraction is not None  # the spec's validator
            work = _with_residual(name, x, residual)
            indices, values = _topk(name, work, spec.fraction)
            tensors[f"{i}.indices"], tensors[f"{i}.values"] = indices, values
            if new_residual is not None:
                decoded = _scatter(indices, values, x.shape, x.dtype)
                new_residual[name] = work - decoded.to(work.dtype)
    if residual is not None and new_residual is not None and residual.keys() - new_residual.keys():
        extra = sorted(residual.keys() - new_residual.keys())
        raise ValueError(f"residual has tensors the delta does not compress: {extra}")
    return Encoded(tensors, {"format": FORMAT, "codec": spec.codec, "tensors": entries}, new_residual)


def quantize_residual(residual: Mapping[str, torch.Tensor], dtype: ResidualDtype) -> Residual:
    """Q: encode's new residual in the dtype it travels in (float32 keeps encode's, bit for bit)."""
    if dtype == "float32":
        return Residual(dict(residual), {})
    if dtype == "int8":
        values: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        for name, r in residual.items():
            values[name], scales[name] = _int8(name, r)
        return Residual(values, scales)
    out: dict[str, torch.Tensor] = {}
    for name, r in residual.items():
        cast_to = r.to(_torch_dtype(dtype))
        if bool((cast_to.isinf() & r.isfinite()).any()):
            raise ValidationError("residual overflows " + dtype, f"{name}: use residual bfloat16 or int8")
        out[name] = cast_to
    return Residual(out, {})


def dequantize_residual(residual: Residual, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A residual as it travelled, back in the work dtype of `like`'s tensors (the delta's)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, values in residual.values.items():
        work = _work_dtype(like[name].dtype) if name in like else torch.float32
        if values.dtype == torch.int8:
            if name not in residual.scales:
                raise ValueError(f"int8 residual {name!r} has no scale")
            out[name] = values.to(work).mul_(residual.scales[name].to(work))
        else:
            out[name] = values.to(work)
    return out


def decode(
    tensors: Mapping[str, Any], meta: Any, expected: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The delta an Encoded carried, in its original dtypes and shapes; malformed input: DecodeError.

    expected (the round's global weights) bounds what a hostile meta may declare: its names,
    dtypes and shapes must be the model's. Tensors may share memory with the inputs (the
    uncompressed ones, and casts to the dtype they already have).
    """
    codec, layout = declared(meta)
    _check_expected(layout, expected)
    wanted = {
        f"{i}.{part}"
        for i, (_, dtype, _) in enumerate(layout)
        for part in (_PARTS[codec] if dtype in COMPRESSED_DTYPES else ("data",))
    }
    if tensors.keys() != wanted:
        missing, extra = sorted(wanted - tensors.keys()), sorted(map(str, tensors.keys() - wanted))
        raise DecodeError(f"compressed update does not match its meta: missing {missing}, unexpected {extra}")
    for key, tensor in tensors.items():
        if not _is_tensor(tensor):
            raise DecodeError(f"compressed update entry {key!r} is a {type(tensor).__name__}, not a tensor")
    out: dict[str, torch.Tensor] = {}
    for i, (name, dtype_name, shape) in enumerate(layout):
        dtype = _torch_dtype(dtype_name)
        if dtype_name not in COMPRESSED_DTYPES:
            out[name] = _checked(tensors[f"{i}.data"], name, "data", dtype, shape)
        elif codec in ("none", "float16", "bfloat16"):
            wire = dtype if codec == "none" else _torch_dtype(codec)
            out[name] = _checked(tensors[f"{i}.data"], name, "data", wire, shape).to(dtype)
        elif codec == "int8":
            out[name] = _decode_int8(name, tensors[f"{i}.q"], tensors[f"{i}.scale"], dtype, shape)
        else:
            out[name] = _decode_topk(name, tensors[f"{i}.indices"], tensors[f"{i}.values"], dtype, shape)
    return out


def declared(meta: Any) -> tuple[Codec, list[tuple[str, str, tuple[int, ...]]]]:
    """Check an encoded delta's metadata; return its codec and each tensor's (name, dtype, shape)."""
    if not isinstance(meta, dict) or set(meta) != {"format", "codec", "tensors"}:
        raise DecodeError("compression meta must be a map with exactly the keys format, codec, tensors")
    if type(meta["format"]) is not int or meta["format"] != FORMAT:
        raise DecodeError(f"compression format {meta['format']!r} is not {FORMAT}: upgrade fedmq")
    codec = meta["codec"]
    if not isinstance(codec, str) or codec not in _PARTS:
        raise DecodeError(f"unknown compression codec {codec!r}; known: {sorted(_PARTS)}")
    if not isinstance(meta["tensors"], list):
        raise DecodeError("compression meta tensors must be a list of [name, dtype, shape]")
    layout: list[tuple[str, str, tuple[int, ...]]] = []
    names: set[str] = set()
    for entry in meta["tensors"]:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise DecodeError(f"compression meta entry {entry!r} is not [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(name, str) or name in names:
            raise DecodeError(f"compression meta names must be distinct strings, got {name!r}")
        if not isinstance(dtype, str) or _torch_dtype_or_none(dtype) is None:
            raise DecodeError(f"{name}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < 2**63 for d in shape)):
            raise DecodeError(f"{name}: shape must be a list of non-negative ints, got {shape!r}")
        names.add(name)
        layout.append((name, dtype, tuple(shape)))
    return cast(Codec, codec), layout


# --- encoding, one tensor at a time ---------------------------------------------------------------


def _cast(name: str, x: torch.Tensor, codec: str) -> torch.Tensor:
    if codec == "none":
        return x
    out = _narrowed(x).to(_torch_dtype(codec))
    if bool((out.isinf() & x.isfinite()).any()):
        raise ValidationError("delta overflows " + codec, f"{name}: use codec bfloat16 or int8 instead")
    return out


def _narrowed(x: torch.Tensor) -> torch.Tensor:
    """A float64 tensor as float32 rounded to odd, which float16 and bfloat16 then round correctly.

    torch casts float64 to either through float32, rounding twice: -110.59374918 became -110.625 in
    float16, where the nearest is -110.5625 (NumPy's). Rounded to odd (toward zero, then the last
    bit set when inexact), the float32 keeps which side of a float16 midpoint the value lies on.
    Other dtypes are returned as they are."""
    import torch

    if x.dtype != torch.float64:
        return x
    near = x.to(torch.float32)
    over = near.to(torch.float64).abs() > x.abs()  # rounded away from zero: one step back
    toward = torch.where(over, torch.nextafter(near, torch.zeros_like(near)), near)
    inexact = (toward.to(torch.float64) != x) & x.isfinite()
    return (toward.view(torch.int32) | inexact.to(torch.int32)).view(torch.float32)


def _int8(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    work = x.to(_work_dtype(x.dtype))
    _require_finite(name, work)
    amax = work.abs().max() if work.numel() else work.new_zeros(())
    scale = (amax / INT8_LEVELS).to(torch.float32)
    if not bool(scale.isfinite()):
        raise ValidationError("delta too large for int8", f"{name}: max |x| {float(amax)}; use codec none")
    if bool(scale == 0):
        return torch.zeros(x.shape, dtype=torch.int8, device=x.device), scale
    q = work.div(scale.to(work.dtype)).round_().clamp_(-INT8_LEVELS, INT8_LEVELS)
    return q.to(torch.int8), scale


def _with_residual(
    name: str, x: torch.Tensor, residual: Mapping[str, torch.Tensor] | None
) -> torch.Tensor:
    work = x.to(_work_dtype(x.dtype), copy=True)
    if residual is not None:
        if name not in residual:
            raise ValueError(f"residual has no tensor {name!r}: pass the residual encode returned")
        r = residual[name]
        if r.shape != x.shape:
            raise ValueError(f"residual {name!r} has shape {tuple(r.shape)}, delta {tuple(x.shape)}")
        work.add_(r.to(work.dtype))
    _require_finite(name, work)
    return work


def _topk(name: str, work: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (ascending) and float32 values of the k largest |x|; on ties the lower index wins."""
    import torch

    flat = work.reshape(-1)
    n = flat.numel()
    k = topk_count(n, fraction)
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    if k == n:
        indices = torch.arange(n, device=flat.device)
    else:
        magnitude = flat.abs()
        threshold = torch.kthvalue(magnitude, n - k + 1).values  # the k-th largest |x|
        above = (magnitude > threshold).nonzero().reshape(-1)
        tied = (magnitude == threshold).nonzero().reshape(-1)[: k - above.numel()]  # nonzero: ascending
        indices = torch.cat([above, tied]).sort().values
    return indices.to(index_dtype), flat[indices].to(torch.float32)


# --- decoding, one tensor at a time ---------------------------------------------------------------


def _decode_int8(
    name: str, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    import torch

    q = _checked(q, name, "q", torch.int8, shape)
    scale = _checked(scale, name, "scale", torch.float32, ())
    if not bool(scale.isfinite()) or bool(scale < 0):
        raise DecodeError(f"{name}: int8 scale must be finite and non-negative, got {float(scale)}")
    if q.numel() and bool(q.eq(-128).any()):
        raise DecodeError(f"{name}: int8 values must lie in [-127, 127]")
    work = _work_dtype(dtype)
    return q.to(work).mul_(scale.to(work)).to(dtype)


def _decode_topk(
    name: str, indices: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    import torch

    n = math.prod(shape)
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise DecodeError(f"{name}: topk indices must be a 1-d int32 or int64 tensor")
    k = indices.numel()
    if k > n or (n > 0 and k == 0):
        raise DecodeError(f"{name}: topk keeps {k} of {n} entries; it must keep 1 to {n}")
    values = _checked(values, name, "values", torch.float32, (k,))
    if k and (int(indices[0]) < 0 or int(indices[-1]) >= n or not bool((indices[1:] > indices[:-1]).all())):
        raise DecodeError(f"{name}: topk indices must be strictly ascending and in [0, {n})")
    return _scatter(indices, values, shape, dtype)


def _scatter(
    indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    import torch

    dense = torch.zeros(math.prod(shape), dtype=dtype, device=values.device)
    dense[indices.long()] = values.to(dtype)
    return dense.reshape(shape)


def _checked(
    tensor: torch.Tensor, name: str, part: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise DecodeError(
            f"{name}: {part} is {tensor.dtype} {list(tensor.shape)}, expected {dtype} {list(shape)}"
        )
    return tensor


def _check_expected(
    layout: list[tuple[str, str, tuple[int, ...]]], expected: Mapping[str, torch.Tensor]
) -> None:
    names = [name for name, _, _ in layout]
    if set(names) != set(expected):
        missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
        raise DecodeError(
            f"compressed update's tensors differ from the model's: missing {missing}, extra {extra}"
        )
    for name, dtype, shape in layout:
        want = expected[name]
        if dtype != _dtype_name(want) or shape != tuple(want.shape):
            model = f"{_dtype_name(want)} {list(want.shape)}"
            raise DecodeError(f"{name}: declared {dtype} {list(shape)}, the model has {model}")


# --- helpers --------------------------------------------------------------------------------------


def _what(spec: CompressionSpec) -> str:
    return "topk without error feedback" if spec.codec == "topk" else f"codec {spec.codec}"


def _require_finite(name: str, work: torch.Tensor) -> None:
    if not bool(work.isfinite().all()):
        raise ValidationError("non-finite delta", f"{name} holds NaN or inf; the client's training diverged")


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; the other float dtypes are computed in float32."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _torch_dtype_or_none(name: str) -> torch.dtype | None:
    import torch

    found = getattr(torch, name, None)  # canonical names only: "float", an alias, is refused
    return found if isinstance(found, torch.dtype) and str(found) == f"torch.{name}" else None


def _torch_dtype(name: str) -> torch.dtype:
    found = _torch_dtype_or_none(name)
    assert found is not None, name
    return found


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)
