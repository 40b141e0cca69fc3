"""`make bench`: every benchmark in turn, their output as it comes, then issue 16's targets gathered.

Each benchmark prints its full report, then one JSON line per target it measures (targets.py).
At the end this prints those lines again, together, and the same as a Markdown table headed with
the date and the machine, and saves them with each benchmark's full report as one JSON file
(--save, default benchmarks/results.json), from which `python scripts/render_benchmarks.py` writes
docs/benchmarks.md. A benchmark that fails is named and the others still run; the exit status is
then 1.

Usage: python benchmarks/all.py [--only NAME[,NAME...]] [--save PATH]   (NAME: a benchmark's file, no .py)

With 16 cores or more, learner_scaling runs 1, 2, 4 and 8 learners (the goal's 8 against one);
with fewer, 1 and 2. With a GPU, gpu_round also runs over RabbitMQ.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

from targets import parse

HERE = Path(__file__).resolve().parent

TIMEOUT_S = 1800  # a benchmark that hangs is killed, named as failed, and the others run

# (file, arguments): the order runs the quick ones first.
BENCHMARKS: list[tuple[str, list[str]]] = [
    ("codec", []),
    ("engine", []),
    ("personalization", []),
    ("embedded", []),
    ("round_overhead", []),
    ("round_overhead", ["--clients", "100", "--rounds", "12"]),
    ("job_length", []),
    ("first_round", []),
    ("large_model", []),
    ("transfer", []),
    ("strategies", []),
    ("robust_memory", []),
    ("fused", []),
    ("fused_run", []),
    ("many_clients", []),
    ("gpu_round", ["--rounds", "3"]),
]


def for_this_machine() -> list[tuple[str, list[str]]]:
    """BENCHMARKS, and what this machine can run of the GPU and 16-core goals."""
    runs = list(BENCHMARKS)
    if _has_gpu():
        runs.append(("gpu_round", ["--rounds", "3", "--bus", "rabbitmq"]))
    runs.append(("learner_scaling", ["--learners", "1,2,4,8" if (os.cpu_count() or 0) >= 16 else "1,2"]))
    return runs


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def machine() -> str:
    """CPU model and cores, and the GPU where torch sees one."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"
    if _has_gpu():
        import torch

        text += f", {torch.cuda.get_device_name(0)}"
    return text


def report_in(output: str) -> dict[str, object] | None:
    """The benchmark's full report: the first JSON object in its output that is no target line."""
    decoder = json.JSONDecoder()
    at = 0
    while (at := output.find("{", at)) >= 0:
        if at == 0 or output[at - 1] == "\n":
            try:
                value, _ = decoder.raw_decode(output, at)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict) and parse(json.dumps(value)) is None:
                return value
        at += 1
    return None


def run(name: str, args: list[str]) -> tuple[int, list[dict[str, object]], dict[str, object] | None]:
    """Run one benchmark, echoing its output; its exit status, target lines and full report."""
    print(f"\n== {name} {' '.join(args)}", flush=True)
    found: list[dict[str, object]] = []
    output: list[str] = []
    with subprocess.Popen([sys.executable, str(HERE / f"{name}.py"), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace", cwd=HERE.parent,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        watchdog = threading.Timer(TIMEOUT_S, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                output.append(line)
                if (target := parse(line)) is not None:
                    found.append({**target, "benchmark": " ".join([f"{name}.py", *args])})
        finally:
            watchdog.cancel()
    return proc.returncode, found, report_in("".join(output))


def table(targets: list[dict[str, object]]) -> str:
    rows = ["| target | figure | baseline | ratio | goal | met |", "|---|---|---|---|---|---|"]
    for t in targets:
        met = {True: "**yes**", False: "no", None: "n/a"}.get(t["met"], "?")  # type: ignore[call-overload]
        what = str(t["what"]).replace("|", "\\|")  # a bar would end the cell
        rows.append(f"| {t['target']} ({what}; `{t['benchmark']}`) | {t['figure']} {t['unit']} | "
                    f"{t['baseline']} {t['unit']} | {t['ratio']} | {t['goal']} | {met} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--save", type=Path, default=HERE / "results.json",
                        help="where the results go as JSON (docs/benchmarks.md is rendered from it)")
    args = parser.parse_args()
    only = {n for n in args.only.split(",") if n}
    runs = for_this_machine()
    unknown = only - {name for name, _ in runs}
    if unknown:
        raise SystemExit(f"no benchmark named {', '.join(sorted(unknown))}; "
                         f"these exist: {', '.join(sorted({name for name, _ in runs}))}")
    began = time.time()
    failed: list[str] = []
    targets: list[dict[str, object]] = []
    reports: dict[str, object] = {}
    for name, arguments in runs:
        if only and name not in only:
            continue
        code, found, report = run(name, arguments)
        targets += found
        if report is not None:
            reports[" ".join([f"{name}.py", *arguments])] = report
        if code != 0:
            failed.append(f"{name} {' '.join(arguments)} (exit {code})".replace("  ", " "))
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    seconds = round(time.time() - began)
    args.save.write_text(json.dumps({"when": when, "machine": machine(), "seconds": seconds,
                                     "only": sorted(only), "failed": failed, "targets": targets,
                                     "reports": reports}, indent=1) + "\n", encoding="utf-8")
    print(f"\n== issue 16's targets, {when}, {machine()}, {seconds} s (saved in {args.save})")
    for target in targets:
        print(json.dumps(target))
    print()
    print(table(targets))
    if failed:
        print(f"\nfailed: {'; '.join(failed)}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
