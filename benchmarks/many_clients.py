"""Logical clients per job: 1,000 a round out of 1,000,000 against out of 10,000 (issue 16).

examples/synthetic.yaml's Task makes each client's data from its id, so no data set bounds the
count; `fedmq run` (embedded, fused training: the many-client simulation this is for) of a few
rounds for each population, each in a fresh child process. Figures: the median
steady round (the faster of two runs) and the process's peak RSS (every service is a thread of it),
the 10,000-client job's the baseline. Prints one JSON object. Target: both ratios <= 1.2.
Usage: python benchmarks/many_clients.py [--rounds N] [--per-round K]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from targets import emit  # noqa: E402 - benchmarks/, the script's own folder


def child(total: int, per_round: int, rounds: int) -> dict[str, Any]:
    from fedmq.common.allowlist import AllowList
    from fedmq.common.jobspec import load_job
    from fedmq.common.logging import configure_logging
    from fedmq.common.settings import Settings
    from fedmq.services.cli.embedded import run_job

    configure_logging("json", "warning")
    spec = load_job(REPO / "examples" / "synthetic.yaml", {
        "clients.total": total, "clients.per_round": per_round, "clients.min_fit": per_round,
        "rounds": rounds,
    })
    with tempfile.TemporaryDirectory() as state:
        settings = Settings(state_dir=Path(state), max_clients=max(total, 100_000))
        result = run_job(spec, settings, allowed=AllowList.project(settings.allowed_prefixes, spec_dir=REPO))
    rounds_s = [h["seconds"] for h in result["history"] if h["round"] > 1]
    return {"status": result["status"], "round_s_median": statistics.median(rounds_s),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=1000)
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.per_round, args.rounds)))
        return
    runs: dict[int, list[dict[str, Any]]] = {10_000: [], 1_000_000: []}
    for total in [*runs, *runs]:  # each twice, alternating: the first process on a cold machine is slower
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(total), "--rounds", str(args.rounds),
             "--per-round", str(args.per_round)], capture_output=True, text=True, check=True, cwd=REPO,
        )
        runs[total].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    small, large = (_best(runs[total]) for total in (10_000, 1_000_000))
    print(json.dumps({
        "benchmark": "many_clients", "clients_per_round": args.per_round, "rounds": args.rounds,
        "round_s_1m": large["round_s_median"], "baseline_round_s_10k": small["round_s_median"],
        "round_ratio": large["round_s_median"] / small["round_s_median"],
        "peak_rss_mib_1m": large["peak_rss_mib"], "baseline_peak_rss_mib_10k": small["peak_rss_mib"],
        "rss_ratio": large["peak_rss_mib"] / small["peak_rss_mib"],
        "status": [small["status"], large["status"]], "target_ratio": 1.2,
    }))
    emit("clients_1m_round", f"{args.per_round} clients a round of 1,000,000 against of 10,000, fused, "
         "embedded: steady round", figure=large["round_s_median"], baseline=small["round_s_median"],
         unit="s a round", at_most=1.2)
    emit("clients_1m_rss", "the same two jobs: the process's peak RSS", figure=large["peak_rss_mib"],
         baseline=small["peak_rss_mib"], unit="MiB", at_most=1.2)


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The faster run's round, the larger peak RSS, every status."""
    return {"round_s_median": min(r["round_s_median"] for r in runs),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
            "status": ",".join(r["status"] for r in runs)}


if __name__ == "__main__":
    main()
