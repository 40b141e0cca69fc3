"""Checks of what a strategy or a Task hands fedmq beside the weights: round configs and tensor maps.

A round config travels in every TrainTask (small messages), so it is a bounded flat map of
plain values. Tensor maps (a client's stored state, the extras an update carries) have bounded
names and counts; the aggregator bounds their size against the model's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,127}$")
MAX_CONFIG_KEYS = 64
MAX_CONFIG_STR = 1000
# Names in one client's state or one update's extras: room for a large model's parameter count
# (SCAFFOLD keeps one control per parameter); their bytes are bounded against the model's size.
MAX_TENSORS = 8192


def check_config(raw: Any) -> dict[str, bool | int | float | str]:
    """A round config as a flat {name: bool | int | float | str}; TypeError/ValueError naming the problem."""
    if not isinstance(raw, Mapping):
        raise TypeError(f"configure() must return a dict of name -> value, got a {type(raw).__name__}")
    if len(raw) > MAX_CONFIG_KEYS:
        raise ValueError(f"configure() returned {len(raw)} keys; at most {MAX_CONFIG_KEYS} go with a task")
    out: dict[str, bool | int | float | str] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"config key {name!r} must match {NAME.pattern}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"config {name!r} is {value}, not finite")
        if isinstance(value, str) and len(value) > MAX_CONFIG_STR:
            raise ValueError(f"config {name!r} has {len(value)} characters (at most {MAX_CONFIG_STR})")
        if not isinstance(value, bool | int | float | str):
            raise TypeError(f"config {name!r} is a {type(value).__name__}; use a number, string or bool")
        out[name] = value
    return out


def check_tensor_map(raw: Any, what: str) -> dict[str, Any]:
    """A {name: tensor} map with bounded, well-formed names; TypeError/ValueError naming the problem."""
    import torch

    if not isinstance(raw, Mapping):
        raise TypeError(f"{what} must be a dict of name -> tensor, got a {type(raw).__name__}")
    if len(raw) > MAX_TENSORS:
        raise ValueError(f"{what} has {len(raw)} tensors; at most {MAX_TENSORS}")
    for name, value in raw.items():
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{what}: name {name!r} must match {NAME.pattern}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}: {name!r} is a {type(value).__name__}, not a tensor")
    return dict(raw)


def check_finite(tensors: Mapping[str, Any], what: str) -> None:
    """ValueError naming the first floating tensor of `tensors` holding NaN or ±inf (others pass)."""
    import torch

    from fedmq.common.finite import all_finite, all_finite_many

    floats = [v for v in tensors.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if len(floats) == len(tensors) and all_finite_many(floats):  # all floating and finite: one check
        return
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            continue
        if not bool(all_finite(value)):
            bad = "nan" if bool(torch.isnan(value).any()) else "inf"
            raise ValueError(
                f"{what}: {name!r} holds non-finite values ({bad}); the strategy's maths overflowed or "
                "divided by zero"
            )
