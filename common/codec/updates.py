"""Compressed client updates: what a learner sends instead of its weights, and how they come back.

    learner     delta = trained - global (float tensors; any other tensor travels as its value)
                compress.encode(delta, spec, residual) ─▶ ClientUpdate.delta + .compression (meta)
                topk's new residual, quantized to the spec's `residual` dtype ─▶ ClientUpdate.extras
                as "fedmq.residual.<name>" (int8: q; its scale as "fedmq.residual_scale.<name>")
    aggregator  check: decode against the round's global weights (a hostile payload: DecodeError)
                ClientResult.load(): global + decoded delta, one tensor per lookup (RestoredWeights)
                the residual's entries as they came ─▶ its own per-client store ─▶ back to the
                learner with the client's state (ClientStateReply), under the same names

The residual rides under RESERVED, a prefix of fedmq's own: a strategy's client state and a
Task's extras never see it, and may not use it. So does a Task's own per-client state (STATE,
common/task/state.py), kept the same way. Tensors in, tensors out: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from fedmq.common.codec.compress import (
    COMPRESSED_DTYPES,
    CompressionSpec,
    Downlink,
    Encoded,
    Residual,
    declared,
    decode,
    dequantize_residual,
    encode,
    quantize_residual,
    rounding_error,
)
from fedmq.common.errors import DecodeError

if TYPE_CHECKING:
    import torch

RESIDUAL = "fedmq.residual."  # extras and client-state names of topk's error-feedback residual
RESIDUAL_SCALE = "fedmq.residual_scale."  # ... and of its per-tensor scales (residual int8)
STATE = "fedmq.state."  # ... and of a Task's per-client state (TrainContext.state)
RESERVED = "fedmq."  # all of them: names only fedmq may use


def is_float(tensor: torch.Tensor) -> bool:
    """Whether the codecs compress this tensor (its delta travels; any other tensor goes as it is)."""
    return str(tensor.dtype).removeprefix("torch.") in COMPRESSED_DTYPES


def delta_of(
    trained: Mapping[str, torch.Tensor], global_weights: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """trained - global for float tensors, the trained value itself for the others (integer buffers)."""
    return {
        name: (w - global_weights[name]) if is_float(w) else w
        for name, w in trained.items()
    }


def compress_update(
    trained: Mapping[str, torch.Tensor],
    global_weights: Mapping[str, torch.Tensor],
    spec: CompressionSpec,
    residual: Residual | None = None,
) -> tuple[Encoded, Residual | None]:
    """A learner's trained weights as an encoded delta from the round's global weights, and the new
    residual as it travels (None without error feedback).

    `residual` is the one the client's previous round sent (None or empty: zeros), dequantized
    before it is added, so the residual of round t+1 is Q(delta + residual_t - decoded).
    """
    delta = delta_of(trained, global_weights)
    previous = dequantize_residual(residual, delta) if residual and residual.values else None
    encoded = encode(delta, spec, previous if spec.keeps_residual else None)
    if encoded.residual is None:
        return encoded, None
    return encoded, quantize_residual(encoded.residual, spec.residual)


def restore(
    global_weights: Mapping[str, torch.Tensor], decoded: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Full weights from a decoded delta: global + delta for float tensors, the value for the others."""
    return {name: _restored(global_weights[name], d) for name, d in decoded.items()}


def _restored(current: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    return current + decoded if is_float(current) else decoded


class RestoredWeights(Mapping[str, "torch.Tensor"]):
    """A compressed update's full weights, each decoded (and checked again) when looked up.

    `tensors` may be a lazy map (codec.TensorFile): a lookup reads only that tensor's parts.
    """

    def __init__(
        self, global_weights: Mapping[str, torch.Tensor], tensors: Mapping[str, Any], meta: Any
    ) -> None:
        self._global = global_weights
        self._tensors = tensors
        self._meta = meta
        self._codec, layout = declared(meta)
        self._index = {entry[0]: i for i, entry in enumerate(layout)}
        self._parts: dict[str, list[str]] = {}  # "<i>" -> that tensor's keys ("<i>.<part>")
        for key in tensors:
            self._parts.setdefault(key.partition(".")[0], []).append(key)

    def __getitem__(self, name: str) -> torch.Tensor:
        i = self._index[name]
        parts = {"0." + key.partition(".")[2]: self._tensors[key] for key in self._parts.get(str(i), [])}
        entry = self._meta["tensors"][i]
        one = {"format": self._meta["format"], "codec": self._codec, "tensors": [entry]}
        decoded = decode(parts, one, {name: self._global[name]})
        return _restored(self._global[name], decoded[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class Rebased(Mapping[str, "torch.Tensor"]):
    """Weights a learner sent whole after training from the rounded global model (compression.
    downlink), each with what the rounding took from the exact model added back when looked up:
    the exact model plus what the client changed, as a delta-coded update restores to. Without it
    a strategy would take each round's rounding error for part of every client's update (an adaptive
    server optimizer, normalizing per coordinate, would step on it)."""

    def __init__(
        self, weights: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor], downlink: Downlink
    ) -> None:
        self._weights = weights
        self._exact = exact
        self._downlink = downlink
        # A rounded tensor's lookup is a new one; another is the update's own, the reader's to write
        # into only when the update's lookups are (a stored update's file, read afresh).
        self.owned_reads: bool = getattr(weights, "owned_reads", False)

    def __getitem__(self, name: str) -> torch.Tensor:
        weights = self._weights[name]
        error = rounding_error(self._exact[name], self._downlink) if name in self._exact else None
        return weights if error is None else weights + error

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def rebased(
    weights: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor], downlink: Downlink
) -> Mapping[str, torch.Tensor]:
    """Whole weights as the aggregator counts them: as sent, or Rebased when trained from a rounded
    model (compression.downlink)."""
    return weights if downlink == "none" else Rebased(weights, exact, downlink)


def split_residual(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], Residual]:
    """(the entries outside RESERVED, the residual by tensor name) of extras or client state."""
    others = {k: v for k, v in tensors.items() if not k.startswith(RESERVED)}
    values = {k[len(RESIDUAL):]: v for k, v in tensors.items() if k.startswith(RESIDUAL)}
    scales = {k[len(RESIDUAL_SCALE):]: v for k, v in tensors.items() if k.startswith(RESIDUAL_SCALE)}
    return others, Residual(values, scales)


def with_prefix(residual: Residual) -> dict[str, torch.Tensor]:
    """A residual as extras or client-state entries, under RESIDUAL and RESIDUAL_SCALE."""
    return {RESIDUAL + name: tensor for name, tensor in residual.values.items()} | {
        RESIDUAL_SCALE + name: tensor for name, tensor in residual.scales.items()
    }


def residual_entries(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fedmq's own entries of extras or client state (the residual, a Task's state), names as they
    are: what the learner keeps per client through the aggregator."""
    return {k: tensors[k] for k in tensors if k.startswith(RESERVED)}


def stray_names(tensors: Mapping[str, Any]) -> list[str]:
    """Names in RESERVED that are neither a residual's value nor its scale."""
    known = (RESIDUAL, RESIDUAL_SCALE, STATE)
    return sorted(k for k in tensors if k.startswith(RESERVED) and not k.startswith(known))


def check_no_prefix(names: Mapping[str, Any], what: str) -> None:
    """ValueError when user code (a Task's extras, a strategy's client state) uses fedmq's prefix."""
    used = sorted(k for k in names if isinstance(k, str) and k.startswith(RESERVED))
    if used:
        raise ValueError(
            f"{what}: names starting with {RESERVED!r} are fedmq's own (compression, client state): "
            f"rename {used[:3]}"
        )


class Without(Mapping[str, "torch.Tensor"]):
    """A lazy map minus the residual's names: what a strategy sees of an update's extras."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._names = [k for k in tensors if not k.startswith(RESERVED)]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name.startswith(RESERVED):
            raise KeyError(name)
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def decode_update(
    tensors: Mapping[str, Any], meta: Any, global_weights: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The full weights a compressed update carries, checked whole; a malformed one raises DecodeError."""
    if meta is None:
        raise DecodeError("a compressed update needs its compression meta")
    return restore(global_weights, decode(tensors, meta, global_weights))
