"""Flat in job length: a steady round late in a long job against one early in it (issue 16).

One embedded job (the scheduler's durable store is the same SQLite as on RabbitMQ), digits with
10 clients a round and one SGD step each (about zero compute), 600 rounds. Figure: the median
round time over rounds 580-600; baseline: the median over rounds 10-30 of the same run.
Two windows a minute apart also see whatever else the machine did in each, so the report adds
the trend of every round's time from round 10 (Theil-Sen: the median of the slopes between all
pairs of rounds, which a burst of slow rounds barely moves) as a second reading. The target line
judges the windows, as the goal is written: a trend over 600 rounds would hide a slowdown of
only the last few dozen. Prints one JSON object, then the target's line. Target: <= 1.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from targets import emit  # noqa: E402 - benchmarks/, the script's own folder

from fedmq.common.jobspec import load_job  # noqa: E402
from fedmq.common.logging import configure_logging  # noqa: E402
from fedmq.common.messages import JobEvent  # noqa: E402
from fedmq.common.settings import Settings  # noqa: E402
from fedmq.services.cli.embedded import run_job  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=600)
    args = parser.parse_args()
    configure_logging("json", "error")
    spec = load_job(REPO / "examples" / "digits.yaml").with_changes(
        rounds=args.rounds, train={"max_steps": 1, "epochs": 1},
        task={"name": "digits", "options": {"model": {"name": "mlp", "hidden": [16]}}},
        evaluate={"every": args.rounds},
    )
    starts: dict[int, float] = {}

    def seen(event: JobEvent) -> None:
        if event.kind == "round_started" and event.round is not None:
            starts[event.round] = time.perf_counter()

    with tempfile.TemporaryDirectory() as state:
        result = run_job(spec, Settings(state_dir=Path(state)), on_event=seen)
    assert result["status"] == "completed", result
    per_round = {r: starts[r + 1] - starts[r] for r in starts if r + 1 in starts}
    late_from = args.rounds - 20
    early = statistics.median(per_round[r] for r in range(10, 31))
    late = statistics.median(per_round[r] for r in range(late_from, args.rounds) if r in per_round)
    first, last = trend({r: t for r, t in per_round.items() if r >= 10}, 10, args.rounds)  # 1-9 warm up
    print(json.dumps({
        "benchmark": "job_length", "rounds": args.rounds,
        "round_s_late": round(late, 5), "baseline_round_s_early": round(early, 5),
        "ratio": round(late / early, 3),
        "trend_round_s_last": round(last, 5), "trend_round_s_10": round(first, 5),
        "trend_ratio": round(last / first, 3), "target_ratio": 1.1,
    }))
    emit("round_600_vs_round_10",
         f"median round of the last 20 of {args.rounds} against that of rounds 10-30, embedded (on the "
         f"Theil-Sen trend of rounds 10-{args.rounds}: {last / first:.3f})",
         figure=late, baseline=early, unit="s a round", at_most=1.1)


def trend(per_round: dict[int, float], first: int, last: int) -> tuple[float, float]:
    """Round `first`'s and round `last`'s time on the Theil-Sen line through every round's time."""
    rounds = np.array(sorted(per_round), dtype=np.float64)
    times = np.array([per_round[int(r)] for r in rounds])
    upper = np.triu_indices(len(rounds), k=1)  # each pair once; rounds are distinct
    rises, runs = (times[None, :] - times[:, None])[upper], (rounds[None, :] - rounds[:, None])[upper]
    slope = float(np.median(rises / runs))
    intercept = float(np.median(times - slope * rounds))
    return intercept + slope * first, intercept + slope * last


if __name__ == "__main__":
    main()
