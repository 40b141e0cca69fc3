"""examples/digits.yaml with one case of tests/support/strategy_cases.py as its strategy: the job the
all-strategies end-to-end test and benchmarks/strategies.py run, shortened where they ask."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.support.strategy_cases import CASES, MIN_FIT

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"


def digits_spec(case: str, rounds: int | None = None, epochs: int | None = None) -> dict[str, Any]:
    """The digits example as a dict, named for `case` and with its strategy section."""
    raw: dict[str, Any] = yaml.safe_load(DIGITS.read_text(encoding="utf-8"))
    raw["name"] = f"digits-{case}"
    raw["strategy"] = CASES[case]
    if case in MIN_FIT:
        raw["clients"]["min_fit"] = max(raw["clients"].get("min_fit", 0), MIN_FIT[case])
    if rounds is not None:
        raw["rounds"] = rounds
    if epochs is not None:
        raw["train"]["epochs"] = epochs
    return raw


def write_digits_spec(folder: Path, case: str, rounds: int | None = None, epochs: int | None = None) -> Path:
    """`digits_spec` written as `folder/<case>.yaml`, for `fedmq submit` and `load_job` alike."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{case}.yaml"
    path.write_text(yaml.safe_dump(digits_spec(case, rounds, epochs), sort_keys=False), encoding="utf-8")
    return path
