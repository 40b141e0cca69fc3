"""Start-up: a fresh `fedmq run` process through its first round against a plain loop's (issue 16).

Both are whole processes from exec to exit, one round of examples/digits.yaml each: `fedmq run
JOB --rounds 1` (the CLI, the services on the in-memory bus, the model saved) and a plain
FedAvg loop (tests/reference.py) in a fresh interpreter. Each runs `--repeat` times, alternating;
the figure is the median. Prints one JSON object.

Usage: python benchmarks/first_round.py [JOB.yaml] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from targets import emit

REPO = Path(__file__).resolve().parent.parent
PLAIN = (
    "import sys; sys.path.insert(0, {repo!r})\n"
    "from fedmq.common.jobspec import load_job\n"
    "from tests.reference import reference_fedavg\n"
    "reference_fedavg(load_job({job!r}, {{'rounds': 1}}))\n"
)


def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("job", nargs="?", default="examples/digits.yaml")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    fedmq = str(Path(sys.executable).with_name("fedmq"))
    runs: dict[str, list[float]] = {"fedmq_run": [], "plain_loop": []}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as state:
            runs["fedmq_run"].append(timed([fedmq, "run", args.job, "--rounds", "1", "--state-dir", state]))
        runs["plain_loop"].append(timed([sys.executable, "-c", PLAIN.format(repo=str(REPO), job=args.job)]))
    fedmq_s, plain_s = (statistics.median(runs[k]) for k in ("fedmq_run", "plain_loop"))
    print(json.dumps({
        "job": args.job,
        "cpus": os.cpu_count(),
        "what": "process wall time, exec to exit, through one round",
        "fedmq_run_s": round(fedmq_s, 3),
        "plain_loop_s": round(plain_s, 3),
        "ratio": round(fedmq_s / plain_s, 3),
        "runs": {k: [round(v, 3) for v in vs] for k, vs in runs.items()},
    }, indent=2))
    emit("first_round", f"`fedmq run {args.job} --rounds 1`, exec to exit, against the plain loop's process",
         figure=fedmq_s, baseline=plain_s, unit="s", at_most=1.3)


if __name__ == "__main__":
    main()
