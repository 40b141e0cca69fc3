"""One JSON line for each of issue 16's targets a benchmark measures: what `make bench` gathers.

A benchmark prints its full report as before, then one line per target, for example

    {"target": "round_10_clients_rabbitmq", "figure": 0.1223, "baseline": 0.0189, "ratio": 6.47,
     "unit": "s a round", "goal": "ratio <= 3", "met": false, ...}

`figure` is fedmq's measurement, `baseline` the one it is compared with in the same run, and
`goal` the target on the ratio or on the figure itself. `met` is null where the goal does not
apply to this run (a GPU target measured on a CPU, 2 learners where the target names 8).
"""

from __future__ import annotations

import json
import math
from typing import Literal

TARGET_KEY = "target"
KEYS = (TARGET_KEY, "what", "figure", "baseline", "ratio", "unit", "goal", "met")


def emit(
    target: str,
    what: str,
    *,
    figure: float,
    baseline: float,
    unit: str,
    ratio: float | None = None,
    at_most: float | None = None,
    at_least: float | None = None,
    on: Literal["ratio", "figure"] = "ratio",
    applies: bool = True,
    why_not: str = "",
) -> dict[str, object]:
    """Print (and return) the target's line. `ratio` defaults to figure / baseline; the goal is
    `on` at most `at_most` or at least `at_least`; `applies=False` says why in `why_not`."""
    if (at_most is None) == (at_least is None):
        raise ValueError("a target needs exactly one of at_most and at_least")
    if ratio is None:
        ratio = figure / baseline if baseline else math.inf
    limit = at_most if at_most is not None else at_least
    assert limit is not None
    value = ratio if on == "ratio" else figure
    met = (value <= limit if at_most is not None else value >= limit) if applies else None
    line: dict[str, object] = {
        TARGET_KEY: target, "what": what, "figure": _rounded(figure), "baseline": _rounded(baseline),
        "ratio": _rounded(ratio), "unit": unit,
        "goal": f"{on} {'<=' if at_most is not None else '>='} {limit:g}", "met": met,
    }
    if not applies:
        line["why_not_applicable"] = why_not
    print(json.dumps(line), flush=True)
    return line


def parse(line: str) -> dict[str, object] | None:
    """A target's line as `emit` printed it; None for any other line of a benchmark's output."""
    text = line.strip()
    if not text.startswith('{"' + TARGET_KEY + '"'):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) and all(key in value for key in KEYS) else None


def _rounded(x: float) -> float:
    return x if not math.isfinite(x) or x == 0 else round(x, max(3, 3 - int(math.floor(math.log10(abs(x))))))
