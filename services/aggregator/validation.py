"""Checks an update must pass before it can touch the global model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from fedmq.common.codec.compress import INT8_LEVELS, CompressionSpec, Residual
from fedmq.common.codec.updates import STATE, decode_update, rebased, split_residual, stray_names
from fedmq.common.errors import DecodeError, ValidationError
from fedmq.common.finite import all_finite
from fedmq.common.messages import ClientUpdate
from fedmq.common.strategy.checks import check_tensor_map
from fedmq.common.task.state import check_state_entries, keeps_state, state_limit
from fedmq.services.aggregator.kernels.private import delta_norm

if TYPE_CHECKING:
    from fedmq.services.aggregator.jobs import AggJob

MAX_EXAMPLES = 2**53  # an example count must at least be a count a float can weigh exactly
EXTRAS_SLACK = 1024 * 1024  # extras may hold up to twice the model's bytes, plus this


def check_update(
    update: ClientUpdate,
    reference: Mapping[str, torch.Tensor],
    max_examples: int = MAX_EXAMPLES,
    expected_extras: frozenset[str] | None = None,
    compression: CompressionSpec | None = None,
    max_norm: float | None = None,
    finite: bool = False,
    task_state: bool = False,
) -> None:
    """Raise ValidationError(reason) unless the update matches the global model exactly.

    `finite`: the caller has seen every value of the update's weights finite (a fused group's rows,
    checked stacked: one call per tensor, not one per member); the check is not repeated.

    `max_examples` bounds the example count it claims (implausible_examples past it); with
    `max_norm`, an update whose weights are further than that from `reference` (L2 over every
    floating tensor) is refused (update_norm).

    Its extras must be finite tensors with well-formed names, no bigger in all than twice the
    model (plus 1 MiB), and exactly the names the strategy expects when it declares them.
    A job with `compression` takes only updates compressed with its codec: decoded against
    `reference` (the round's global weights), they must give full weights that pass the same
    checks; topk's residual rides in the extras (see common/codec/updates.py) in the job's
    residual dtype, and only when the job has error feedback; the client's own state only
    when `task_state` (the job keeps it).
    """
    if not 0 < update.num_examples <= MAX_EXAMPLES:
        raise ValidationError("bad_example_count", f"{update.num_examples} not in 1..{MAX_EXAMPLES}")
    if update.num_examples > max_examples:
        raise ValidationError(
            "implausible_examples", f"{update.num_examples} examples claimed, at most {max_examples} "
            "for this client (clients.max_examples, or the count of its first accepted update)"
        )
    spec = compression if compression is not None else CompressionSpec()
    extras, residual = split_residual(update.extras)
    weights = _full_weights(update, reference, spec.codec)
    check_weights(weights, reference, finite=finite and weights is update.weights)
    check_residual(residual, reference, spec, stray_names(update.extras))
    check_state(update.extras, reference, task_state)
    check_extras(extras, reference, expected_extras)
    if max_norm is not None:  # what the client changed: whole weights trained from a rounded model
        # (compression.downlink) get the rounding back first, as the strategy will see them
        check_norm(rebased(update.weights, reference, spec.downlink) if spec.codec == "none" else weights,
                   reference, max_norm)


def check_job_update(job: AggJob, msg: ClientUpdate, finite: bool = False) -> None:
    """`check_update` with the job's bounds: its clients' example counts, extras, codec and norm."""
    clients = job.spec.clients
    max_examples = min(clients.max_examples or MAX_EXAMPLES, job.examples.get(msg.client, MAX_EXAMPLES))
    check_update(
        msg, job.weights, max_examples=max_examples, expected_extras=job.strategy.expected_extras,
        compression=job.spec.compression,
        max_norm=clients.max_update_norm if clients.on_large_update == "reject" else None,
        finite=finite, task_state=keeps_state(job.spec, job.runtime.task),
    )


def check_norm(weights: Mapping[str, object], reference: Mapping[str, torch.Tensor], max_norm: float) -> None:
    """Raise ValidationError("update_norm") if `weights` lie further than `max_norm` from `reference`."""
    norm = delta_norm(weights, reference)  # type: ignore[arg-type]  # check_weights: every one a tensor
    if norm > max_norm:
        raise ValidationError(
            "update_norm", f"update norm {norm:.6g} is over clients.max_update_norm ({max_norm:g})"
        )


def _full_weights(
    update: ClientUpdate, reference: Mapping[str, torch.Tensor], codec: str
) -> Mapping[str, object]:
    """The update's weights: as sent, or decoded from its compressed delta (bad_compression if not)."""
    compressed = update.compression is not None or bool(update.delta)
    if codec == "none":
        if compressed:
            raise ValidationError("bad_compression", "this job's updates are not compressed: send weights")
        return update.weights
    if not compressed or update.weights:
        raise ValidationError("bad_compression", f"this job compresses updates with {codec}: send delta only")
    declared_codec = update.compression.get("codec") if isinstance(update.compression, dict) else None
    if declared_codec != codec:
        raise ValidationError("bad_compression", f"codec {declared_codec!r}, this job's is {codec}")
    try:
        return decode_update(update.delta, update.compression, reference)
    except DecodeError as exc:
        raise ValidationError("bad_compression", str(exc)) from None


def check_state(
    extras: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], kept: bool
) -> None:
    """A client's state for its next round (common/task/state.py): only in a job that keeps it,
    well-formed, at most four times the model (Adam's moments are two) and 1 MiB."""
    entries = {k: v for k, v in extras.items() if k.startswith(STATE)}
    if entries and not kept:
        raise ValidationError("bad_state", "client state in an update of a job that keeps none")
    try:
        check_state_entries(entries, state_limit(reference))
    except ValueError as exc:
        raise ValidationError("bad_state", str(exc)) from None


def check_residual(
    residual: Residual, reference: Mapping[str, torch.Tensor], spec: CompressionSpec,
    stray: Sequence[str] = (),
) -> None:
    """topk's residual: exactly the model's float tensors in the job's residual dtype, finite.

    float32 means the work dtype (float64 for a float64 tensor); int8 is q (in [-127, 127]) with
    a finite, non-negative float32 scale per tensor. Without error feedback nothing may come.
    """
    if stray:
        raise ValidationError("bad_compression", f"unknown residual entries {list(stray)[:3]}")
    if not spec.keeps_residual:
        if residual.values or residual.scales:
            what = "topk without error feedback" if spec.codec == "topk" else f"codec {spec.codec}"
            raise ValidationError("bad_compression", f"{what} keeps no residual")
        return
    floats = {k: v for k, v in reference.items() if v.is_floating_point()}
    scaled = set(floats) if spec.residual == "int8" else set()
    for part, got_names, want_names in (("residual", set(residual.values), set(floats)),
                                        ("residual scales", set(residual.scales), scaled)):
        if got_names != want_names:
            missing, extra = sorted(want_names - got_names)[:3], sorted(got_names - want_names)[:3]
            raise ValidationError("bad_compression", f"{part}: missing {missing}, unexpected {extra}")
    for name, ref in floats.items():
        want = _residual_dtype(spec, ref.dtype)
        _check_residual_tensor(residual.values[name], name, want, tuple(ref.shape))
        if spec.residual == "int8":
            _check_int8(residual.values[name], residual.scales[name], name)


def _residual_dtype(spec: CompressionSpec, model_dtype: torch.dtype) -> torch.dtype:
    if spec.residual == "float32":
        return torch.float64 if model_dtype == torch.float64 else torch.float32
    dtype: torch.dtype = getattr(torch, spec.residual)
    return dtype


def _check_residual_tensor(got: object, name: str, want: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(got, torch.Tensor) or got.dtype != want or tuple(got.shape) != shape:
        raise ValidationError("bad_compression", f"residual {name} must be {want} {list(shape)}")
    if got.is_floating_point() and not bool(torch.isfinite(got).all()):
        raise ValidationError("non_finite", f"residual {name} has NaN or infinite values")
    if got.is_floating_point() and got.numel() and float(got.abs().max()) > RESIDUAL_LIMIT:
        raise ValidationError("bad_compression", f"residual {name} holds values past float32's range / 4")


def _check_int8(q: torch.Tensor, scale: object, name: str) -> None:
    _check_residual_tensor(scale, f"{name} scale", torch.float32, ())
    assert isinstance(scale, torch.Tensor)
    if bool(scale < 0):
        raise ValidationError("bad_compression", f"residual {name} scale must be non-negative")
    if q.numel() and bool(q.eq(-INT8_LEVELS - 1).any()):  # int8 holds the rest of [-128, 127]
        raise ValidationError("bad_compression", f"residual {name} values must lie in [-127, 127]")
    if float(scale) * INT8_LEVELS > RESIDUAL_LIMIT:
        raise ValidationError("bad_compression", f"residual {name} scale {float(scale):.3g} is too large")


# A residual is added to the client's next delta in float32: one this large would overflow there
# (and fail that client's every later round as "diverged"); a real residual is a fraction of a delta.
RESIDUAL_LIMIT = float(torch.finfo(torch.float32).max) / 4


def check_weights(
    weights: Mapping[str, object], reference: Mapping[str, torch.Tensor], finite: bool = False
) -> None:
    """Raise ValidationError unless `weights` has the model's names, dtypes and shapes, all finite
    (`finite`: known to be, not looked at again)."""
    if set(weights) != set(reference):
        missing = sorted(set(reference) - set(weights))[:3]
        extra = sorted(set(weights) - set(reference))[:3]
        raise ValidationError("wrong_tensors", f"missing {missing}, unexpected {extra}")
    for name, ref in reference.items():
        got = weights[name]
        if not isinstance(got, torch.Tensor):
            raise ValidationError("wrong_tensors", f"{name} is not a tensor")
        if got.dtype != ref.dtype:
            raise ValidationError("wrong_dtype", f"{name}: {got.dtype}, expected {ref.dtype}")
        if got.shape != ref.shape:
            raise ValidationError(
                "wrong_shape", f"{name}: {tuple(got.shape)}, expected {tuple(ref.shape)}"
            )
        if not finite and got.is_floating_point() and not bool(all_finite(got)):
            raise ValidationError("non_finite", f"{name} has NaN or infinite values")


def check_extras(
    extras: Mapping[str, object], reference: Mapping[str, torch.Tensor], expected: frozenset[str] | None
) -> None:
    """Raise ValidationError unless an update's extras are within bounds (see check_update)."""
    try:
        tensors = check_tensor_map(extras, "extras")
    except (TypeError, ValueError) as exc:
        raise ValidationError("wrong_extras", str(exc)) from None
    if expected is not None and set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
        raise ValidationError("wrong_extras", f"missing {missing}, unexpected {extra}")
    limit = 2 * sum(t.numel() * t.element_size() for t in reference.values()) + EXTRAS_SLACK
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > limit:
        raise ValidationError("wrong_extras", f"{size} bytes of extras, more than {limit}")
    for name, tensor in tensors.items():
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(all_finite(tensor)):
            raise ValidationError("non_finite", f"extras {name} has NaN or infinite values")
