"""`fedmq run` with `train.fuse` against the same job unfused and a plain FedAvg loop (issue 18).

Digits, 5 local epochs, every client of a round trained: 10 clients per round (examples/digits.yaml)
and 100 (examples/digits-100.yaml with all 100 sampled: 4-30 examples each). Each measurement runs
in a fresh child process; the figure is the median steady round (rounds after the first), and
the fused run's final weights are compared with the unfused run's. Prints one JSON object.
Usage: python benchmarks/fused_run.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "10_clients_per_round": ("examples/digits.yaml", {}),
    "100_clients_per_round": ("examples/digits-100.yaml", {"clients.per_round": 100, "clients.min_fit": 100}),
}


def child_fedmq(job: str, overrides: dict[str, Any], weights_out: str) -> dict[str, Any]:
    import shutil

    from fedmq.common.jobspec import load_job
    from fedmq.common.logging import configure_logging
    from fedmq.common.settings import Settings
    from fedmq.services.cli.embedded import run_job

    configure_logging("json", "warning")
    with tempfile.TemporaryDirectory() as state:
        result = run_job(load_job(job, overrides), Settings(state_dir=Path(state)))
        shutil.copy(result["model_path"], weights_out)
    rounds = [h["seconds"] for h in result["history"] if h["round"] > 0]
    return {"status": result["status"], "round_s_median": statistics.median(rounds[1:]),
            "final": result.get("final", {}), "fused_groups": len(result["fused_groups"])}


def child_plain(job: str, overrides: dict[str, Any]) -> dict[str, Any]:
    from fedmq.common.jobspec import load_job
    from tests.reference import reference_fedavg

    rounds = reference_fedavg(load_job(job, overrides))["round_seconds"]
    return {"round_s_median": statistics.median(rounds[1:])}


def run_child(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                          check=True, cwd=REPO)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def max_difference(a: str, b: str) -> float:
    from fedmq.common.checkpoint import load_state

    wa, wb = load_state(a)[0], load_state(b)[0]
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "JOB", "OVERRIDES"))
    parser.add_argument("--weights-out", default="")
    args = parser.parse_args()
    if args.child:
        kind, job, raw = args.child
        overrides = json.loads(raw)
        if kind == "plain":
            print(json.dumps(child_plain(job, overrides)))
        else:
            print(json.dumps(child_fedmq(job, overrides, args.weights_out)))
        return
    report: dict[str, Any] = {"benchmark": "fused_run", "cpus": os.cpu_count(), "rounds": args.rounds}
    with tempfile.TemporaryDirectory() as out:
        for case, (job, extra) in CASES.items():
            if os.environ.get("ONLY") and case != os.environ["ONLY"]:
                continue
            base = {"rounds": args.rounds, **extra}
            paths = {fuse: str(Path(out) / f"{case}-{fuse}.safetensors") for fuse in (True, False)}
            fused = run_child("fedmq", job, json.dumps({**base, "train.fuse": True}), "--weights-out",
                              paths[True])
            unfused = run_child("fedmq", job, json.dumps(base), "--weights-out", paths[False])
            plain = run_child("plain", job, json.dumps(base))
            report[case] = {
                "fused_round_s": fused["round_s_median"], "unfused_round_s": unfused["round_s_median"],
                "plain_loop_round_s": plain["round_s_median"],
                "fused_vs_plain_loop": fused["round_s_median"] / plain["round_s_median"],
                "fused_vs_unfused": fused["round_s_median"] / unfused["round_s_median"],
                "fused_groups": fused["fused_groups"], "unfused_groups": unfused["fused_groups"],
                "weights_max_difference_vs_unfused": max_difference(paths[True], paths[False]),
                "status": [fused["status"], unfused["status"]],
            }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
