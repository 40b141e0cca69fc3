"""Metrics as data: names, checks, and how per-client values combine into one. Pure, no torch.

A round's metrics come from five sources and travel as {source: {name: value}}:

    train      what clients' training reported, combined over the round's clients
    federated  what sampled clients' evaluation of the global model reported, combined
    server     the aggregator's evaluation of the global model on the Task's server data
    strategy   what the strategy reports about its own work (norms, clipped counts, epsilon)
    transport  what the round's messages cost on the wire (update_bytes: the updates as received;
               state_bytes: the client state they carried, topk's residual, within update_bytes)

Combining is example-weighted by default; a Task names other rules per metric
(`Task.metric_reduction`): sum, min, max, or geometric (an example-weighted geometric mean,
right for perplexities).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, get_args

from fedmq.common.task.contract import Reduction

SOURCES = ("train", "federated", "personal", "server", "strategy", "transport")
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")
MAX_NAMES = 32  # per source and job: Prometheus label values stay bounded
REDUCTIONS: frozenset[str] = frozenset(get_args(Reduction))


class MetricError(ValueError):
    """Metrics a Task returned break the rules; the message says which and why."""


def check_metrics(raw: Any, what: str) -> dict[str, float]:
    """Metrics from user code as {name: finite float}; MetricError naming the first problem."""
    if not isinstance(raw, Mapping):
        raise MetricError(f"{what} must be a dict of name -> number, got a {type(raw).__name__}")
    if len(raw) > MAX_NAMES:
        raise MetricError(f"{what} has {len(raw)} metrics; at most {MAX_NAMES} are kept")
    out: dict[str, float] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not NAME.match(name):
            raise MetricError(f"{what}: metric name {name!r} must match {NAME.pattern}")
        number = _number(value)
        if number is None:
            raise MetricError(f"{what}: metric {name!r} is a {type(value).__name__}, not a number")
        if not math.isfinite(number):
            raise MetricError(f"{what}: metric {name!r} is {number}, not finite")
        out[name] = number
    return out


def reduce_metrics(
    reports: Iterable[tuple[int, Mapping[str, float]]], rules: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Combine per-client (num_examples, metrics) into one value per name (see module docstring).

    A metric only some clients reported combines over those clients. Clients with no
    examples count in sum, min and max, not in the weighted means.
    """
    rules = rules or {}
    columns: dict[str, list[tuple[int, float]]] = {}
    for count, metrics in reports:
        for name, value in metrics.items():
            columns.setdefault(name, []).append((count, value))
    return {name: _reduce(rules.get(name, "mean"), pairs) for name, pairs in sorted(columns.items())}


def _reduce(rule: str, pairs: list[tuple[int, float]]) -> float:
    values = [v for _, v in pairs]
    if rule == "sum":
        return math.fsum(values)
    if rule == "min":
        return min(values)
    if rule == "max":
        return max(values)
    total = sum(n for n, _ in pairs)
    if total <= 0:
        return math.fsum(values) / len(values)
    if rule == "geometric":
        if any(v <= 0 for v in values):
            return math.nan
        return math.exp(math.fsum(n * math.log(v) for n, v in pairs) / total)
    return math.fsum(n * v for n, v in pairs) / total


def check_rules(raw: Any) -> dict[str, str]:
    """A Task's `metric_reduction`, checked: names as for metrics, rules from REDUCTIONS."""
    if not isinstance(raw, Mapping):
        raise MetricError(f"metric_reduction must be a dict of name -> rule, got a {type(raw).__name__}")
    for name, rule in raw.items():
        if not isinstance(name, str) or not NAME.match(name) or rule not in REDUCTIONS:
            raise MetricError(
                f"metric_reduction[{name!r}] = {rule!r}: rules are {', '.join(sorted(REDUCTIONS))}"
            )
    return dict(raw)


def lookup(metrics: Mapping[str, Mapping[str, float]], dotted: str) -> float | None:
    """The value of "source.name" in {source: {name: value}}, or None."""
    source, _, name = dotted.partition(".")
    value = metrics.get(source, {}).get(name)
    return None if value is None or not math.isfinite(value) else float(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    item = getattr(value, "item", None)  # a 0-d tensor or a NumPy scalar
    if callable(item) and getattr(value, "ndim", None) == 0:
        result = item()
        return float(result) if isinstance(result, int | float) and not isinstance(result, bool) else None
    return None
