"""Accuracy of every built-in strategy on examples/digits.yaml: one embedded run per case of
tests/support/strategy_cases.py, with its final and best server accuracy and its wall time.

Prints one JSON object; --markdown prints the table docs/benchmarks.md shows instead.
Usage: python benchmarks/strategies.py [--rounds N] [--case NAME ...] [--markdown]
       python benchmarks/strategies.py --markdown --from REPORT.json   (a saved report's table)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fedmq.common.jobspec import parse_job  # noqa: E402 - after the path insert above
from fedmq.common.logging import configure_logging  # noqa: E402
from fedmq.common.settings import Settings  # noqa: E402
from fedmq.services.cli.embedded import run_job  # noqa: E402
from tests.support.strategy_cases import CASES  # noqa: E402
from tests.support.strategy_specs import digits_spec  # noqa: E402


def accuracy_of(result: dict[str, Any]) -> dict[str, Any]:
    """Final and best server accuracy of a finished run, and the round that was best."""
    scored = [(h["metrics"]["server"]["accuracy"], h["round"]) for h in result["history"]
              if h["round"] > 0 and "accuracy" in h["metrics"].get("server", {})]
    best, best_round = max(scored, key=lambda pair: (pair[0], -pair[1]))
    return {"final_accuracy": scored[-1][0], "best_accuracy": best, "best_round": best_round}


def run_case(case: str, rounds: int | None) -> dict[str, Any]:
    """One embedded run of the digits job with `case`'s strategy."""
    spec = parse_job(digits_spec(case, rounds), f"examples/digits.yaml with {case}")
    with tempfile.TemporaryDirectory() as state:
        result = run_job(spec, Settings(state_dir=Path(state), device="cpu"))
    if result["status"] != "completed":
        return {"case": case, "status": result["status"], "reason": result.get("reason")}
    return {
        "case": case,
        "status": "completed",
        "strategy": CASES[case],
        "rounds": spec.rounds,
        **accuracy_of(result),
        "seconds": result["wall_seconds"],
    }


def markdown(report: dict[str, Any]) -> str:
    """The benchmarks page's table: one row per case."""
    lines = [
        "| strategy | options | final accuracy | best accuracy (round) | seconds |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in report["cases"]:
        if row["status"] != "completed":
            lines.append(f"| `{row['case']}` | | {row['status']}: {row['reason']} | | |")
            continue
        options = ", ".join(f"{k}: {_short(v)}" for k, v in row["strategy"].get("options", {}).items())
        lines.append(
            f"| `{row['case']}` | {options} | {row['final_accuracy']:.3f} | "
            f"{row['best_accuracy']:.3f} ({row['best_round']}) | {row['seconds']:.1f} |"
        )
    return "\n".join(lines)


def _short(value: Any) -> str:
    """An option's value for the table: a long list is shown by its length."""
    if isinstance(value, list) and len(value) > 3:
        return f"[{len(value)} values]"
    return json.dumps(value)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, help="rounds per run (default: the example's 30)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases")
    parser.add_argument("--markdown", action="store_true", help="print the benchmarks page's table")
    parser.add_argument("--from", dest="saved", type=Path, help="a report printed before: no runs")
    args = parser.parse_args()
    if args.saved:
        report = json.loads(args.saved.read_text(encoding="utf-8"))
    else:
        configure_logging("json", "warning")
        cases = args.case or list(CASES)
        run_case(cases[0], rounds=1)  # warm-up, not reported: the first run loads the data and torch
        report = {
            "job": "examples/digits.yaml",
            "cpus": os.cpu_count(),
            "cases": [run_case(case, args.rounds) for case in cases],
        }
    print(markdown(report) if args.markdown else json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
