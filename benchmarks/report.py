"""docs/benchmarks.md's figures, rendered from the results `make bench` saved (benchmarks/results.json).

The page's prose is written by hand; everything between its markers is this module's output, so no
figure on it is copied by hand. A test fails when the page's copy differs from the saved results.

Usage: python benchmarks/report.py                      print the generated part
       python benchmarks/report.py --write docs/benchmarks.md [--from benchmarks/results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
STRATEGIES = "strategies.py"
MET = {True: "**yes**", False: "no", None: "n/a"}


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def targets_table(targets: list[dict[str, Any]]) -> str:
    """One row per target line: fedmq's figure, the baseline of the same run, the goal."""
    rows = ["| target | what | figure | baseline | ratio | goal | met |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for t in targets:
        rows.append(f"| `{t['target']}` | {_cell(t['what'])} (`{t['benchmark']}`) | "
                    f"{t['figure']} {t['unit']} | {t['baseline']} {t['unit']} | {t['ratio']} | {t['goal']} | "
                    f"{MET.get(t['met'], '?')} |")
    return "\n".join(rows)


def strategies_table(report: dict[str, Any]) -> str:
    """One row per built-in strategy of benchmarks/strategies.py's report."""
    rows = ["| strategy | options | final accuracy | best accuracy (round) | seconds |",
            "| --- | --- | --- | --- | --- |"]
    for row in report["cases"]:
        if row["status"] != "completed":
            rows.append(f"| `{row['case']}` | | {row['status']}: {_cell(row.get('reason'))} | | |")
            continue
        options = ", ".join(f"{k}: {_short(v)}" for k, v in row["strategy"].get("options", {}).items())
        rows.append(f"| `{row['case']}` | {_cell(options)} | {row['final_accuracy']:.3f} | "
                    f"{row['best_accuracy']:.3f} ({row['best_round']}) | {row['seconds']:.1f} |")
    return "\n".join(rows)


def _short(value: object) -> str:
    if isinstance(value, list) and len(value) > 3:
        return f"[{len(value)} values]"
    return json.dumps(value)


SCALAR = bool | int | float | str


def _fields(value: object, name: str, depth: int) -> list[tuple[str, str]]:
    """(dotted name, shown value) of a report's numbers, strings, flags and short lists of them."""
    if isinstance(value, SCALAR):
        return [(name, str(value))]
    if isinstance(value, list) and 0 < len(value) <= 10 and all(isinstance(v, SCALAR) for v in value):
        return [(name, ", ".join(str(v) for v in value))]
    if isinstance(value, dict) and depth < 3:
        return [field for key, v in value.items()
                for field in _fields(v, f"{name}.{key}" if name else str(key), depth + 1)]
    return []


def scalars_table(report: dict[str, Any]) -> str:
    """A report's figures, nested names dotted; longer lists and deeper parts stay in results.json."""
    rows = ["| field | value |", "| --- | --- |"]
    rows += [f"| `{name}` | {_cell(value)} |" for name, value in _fields(report, "", 0)]
    return "\n".join(rows)


def generated(results: dict[str, Any] | None) -> str:
    """The page's generated part: when and where, the targets, the strategies, each report's figures."""
    if results is None:
        return "No results are saved yet: `make bench` writes them."
    only = f", only {', '.join(results['only'])}" if results.get("only") else ""
    parts = [f"Saved by `benchmarks/all.py` on {results['when']}, on {results['machine']}, "
             f"in {results['seconds']} s{only}."]
    if results.get("failed"):
        parts.append(f"Failed: {'; '.join(results['failed'])}.")
    parts.append("### Targets")
    parts.append(targets_table(results["targets"]) if results["targets"] else "No target was measured.")
    reports: dict[str, Any] = results.get("reports", {})
    parts.append("### Strategies")
    strategies = next((r for name, r in reports.items() if name.split()[0] == STRATEGIES), None)
    if strategies is None:
        parts.append("`benchmarks/strategies.py` did not run.")
    else:
        parts.append(f"Final and best server accuracy on `{strategies['job']}`, one embedded run per "
                     f"strategy, on {strategies['cpus']} cores; seconds are wall time.")
        parts.append(strategies_table(strategies))
    parts.append("### Every report")
    for name, report in reports.items():
        if name.split()[0] != STRATEGIES:
            parts.append(f"`{name}`:")
            parts.append(scalars_table(report))
    return "\n\n".join(parts)


def render(page: str, results: dict[str, Any] | None) -> str:
    """The page with its generated part replaced by the one `results` gives."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated(results)}\n{END}{tail}"


def load(path: Path = RESULTS) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="the page whose generated part to replace")
    parser.add_argument("--from", dest="source", type=Path, default=RESULTS, help="the saved results")
    args = parser.parse_args()
    results = load(args.source)
    if args.write:
        args.write.write_text(render(args.write.read_text(encoding="utf-8"), results), encoding="utf-8")
    else:
        print(generated(results))


if __name__ == "__main__":
    main()
