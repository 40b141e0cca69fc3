"""Checks an update must pass before it can touch the global model."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedmq.common.errors import ValidationError
from fedmq.common.messages import ClientUpdate

MAX_EXAMPLES = 2**53  # an example count must at least be a count a float can weigh exactly


def check_update(
    update: ClientUpdate, reference: Mapping[str, torch.Tensor], max_examples: int = MAX_EXAMPLES
) -> None:
    """Raise ValidationError(reason) unless the update matches the global model exactly."""
    if not 0 < update.num_examples <= max_examples:
        raise ValidationError(
            "bad_example_count", f"{update.num_examples} not in 1..{max_examples}"
        )
    weights = update.weights
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
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise ValidationError("non_finite", f"{name} has NaN or infinite values")
