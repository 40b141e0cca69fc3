"""The figures of a device check (scripts/device-check.sh), from its stages' logs.

    python scripts/device_summary.py WORK RESULTS_JSON

Each benchmark prints one indented JSON object; its log may hold log lines before or after it.
The object is the last one that starts on a line of its own `{`. Writes every benchmark's object
to RESULTS_JSON by stage and prints the figures the open issues ask for, beside their targets,
and each test stage's last line. A log without a readable object is named, not fatal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = ("fused", "gpu_round", "scaling", "gpu_round_mq", "fused_run")
TESTS = ("gpu_tests", "suite")


def last_json(text: str) -> dict[str, Any] | None:
    """The last JSON object in `text` that starts on a line of its own `{`; None if there is none."""
    lines = text.splitlines(keepends=True)
    decoder = json.JSONDecoder()
    for at in range(len(lines) - 1, -1, -1):
        if lines[at].strip() != "{":
            continue
        try:
            value, _ = decoder.raw_decode("".join(lines[at:]))
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def figures(results: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(what, figure) for each benchmark that gave its object."""
    rows = []
    if (fused := results.get("fused")) is not None:
        case = fused["cases"]["100_clients_per_round"]
        speedup = case["sequential_loop_baseline_round_s"] / case["fused_round_s"]
        rows.append((f"fused kernel, 100 clients, {fused.get('device')}: sequential / fused (target >= 10)",
                     f"{speedup:.1f}x ({case['fused_round_s']:.4f} s a round)"))
    for name in ("gpu_round", "gpu_round_mq"):
        if (run := results.get(name)) is not None:
            outside, whole = run["outside_training_s_median"], run["round_s_median"]
            rows.append((f"{name}, {run['model_mb']} MB on {run['device']}: outside training (target <= 1 s)",
                         f"{outside:.2f} s of a {whole:.2f} s round"))
    if (scaling := results.get("scaling")) is not None:
        ratios = ", ".join(f"{n}: {row['throughput_over_first']}x" for n, row in scaling["runs"].items())
        rows.append((f"learners, throughput over one ({scaling['cpus']} cores; target 8 >= 6x)", ratios))
    if (run := results.get("fused_run")) is not None:
        for case in ("10_clients_per_round", "100_clients_per_round"):
            if case in run:
                unfused, fused = run[case]["unfused_round_s"], run[case]["fused_round_s"]
                figure = f"{unfused / fused:.1f}x ({fused:.3f} s)"
                rows.append((f"fedmq run, {case}: unfused / fused", figure))
    return rows


def main(work: Path, out: Path) -> None:
    results: dict[str, dict[str, Any]] = {}
    for name in BENCHMARKS:
        log = work / f"{name}.log"
        if not log.exists():
            continue
        value = last_json(log.read_text(errors="replace"))
        if value is None:
            print(f"{name}: no JSON object in its log (logs.txt)")
        else:
            results[name] = value
    out.write_text(json.dumps(results, indent=1))
    for what, figure in figures(results):
        print(f"{what:78s} {figure}")
    for name in TESTS:
        log = work / f"{name}.log"
        if log.exists():
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            print(f"{name}: {tail[-1] if tail else '(no output)'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
