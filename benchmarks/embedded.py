"""Embedded-mode cost: `fedmq run` on a job vs a plain FedAvg loop doing the same training.

Each measurement runs in a fresh child process so peak memory (ru_maxrss) is its own.
Prints one JSON object. Usage: python benchmarks/embedded.py [JOB.yaml] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def child_fedmq(job: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The whole job through scheduler, aggregator and learner on the in-memory bus."""
    from fedmq.common.allowlist import AllowList
    from fedmq.common.jobspec import load_job
    from fedmq.common.logging import configure_logging
    from fedmq.common.settings import Settings
    from fedmq.services.cli.embedded import run_job

    configure_logging("json", "warning")
    spec = load_job(job, overrides)
    with tempfile.TemporaryDirectory() as state:
        settings = Settings(state_dir=Path(state))
        # As `fedmq run` does: the job's own code (examples/...) is this project's.
        allowed = AllowList.project(settings.allowed_prefixes, spec_dir=Path(job).resolve().parent)
        result = run_job(spec, settings, allowed=allowed)
    rounds = [h["seconds"] for h in result["history"] if h["round"] > 0]
    return {
        "status": result["status"],
        "final_accuracy": result.get("final", {}).get("server.accuracy"),
        "wall_s": result["wall_seconds"],
        "round_s_median": statistics.median(rounds),
        "round_s_min": min(rounds),
        "round_s_max": max(rounds),
        "first_round_s": rounds[0],
    }


def child_plain(job: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The same training and FedAvg maths in one loop: no bus, no services, no disk."""
    from fedmq.common.jobspec import load_job
    from tests.reference import reference_fedavg

    started = time.perf_counter()
    out = reference_fedavg(load_job(job, overrides))
    rounds = out["round_seconds"]
    return {
        "final_accuracy": out["accuracies"][-1],
        "wall_s": time.perf_counter() - started,
        "round_s_median": statistics.median(rounds),
        "round_s_min": min(rounds),
        "round_s_max": max(rounds),
    }


def measure(kind: str, job: str, overrides: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, job, "--overrides", json.dumps(overrides)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = time.perf_counter() - t0  # includes interpreter and torch import
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("job", nargs="?", default="examples/digits.yaml")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--child", choices=["fedmq", "plain"])
    parser.add_argument("--overrides", default="{}")
    args = parser.parse_args()
    overrides = json.loads(args.overrides)
    if args.child:
        result = (child_fedmq if args.child == "fedmq" else child_plain)(args.job, overrides)
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    base = {"rounds": args.rounds} if args.rounds else {}
    one_step = {**base, "train.max_steps": 1}
    report = {
        "job": args.job,
        "cpus": os.cpu_count(),
        "full_training": {
            "fedmq_run": measure("fedmq", args.job, base),
            "plain_loop_baseline": measure("plain", args.job, base),
        },
        "one_sgd_step_per_client": {
            "fedmq_run": measure("fedmq", args.job, one_step),
            "plain_loop_baseline": measure("plain", args.job, one_step),
        },
    }
    for section in ("full_training", "one_sgd_step_per_client"):
        s = report[section]
        s["overhead_per_round_s"] = (
            s["fedmq_run"]["round_s_median"] - s["plain_loop_baseline"]["round_s_median"]
        )
        fedmq_s, plain_s = s["fedmq_run"]["process_wall_s"], s["plain_loop_baseline"]["process_wall_s"]
        s["wall_ratio_vs_plain"] = fedmq_s / plain_s
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
