"""Throughput against learner processes: 1, 2, 4, 8 CPU learners on RabbitMQ (issue 16).

Real scheduler, aggregator and N learner processes (one torch thread each) on a fresh vhost of
the test broker (tests/rabbit.py), one job per N: digits, 40 clients every round, an MLP of two
512-wide layers trained `--epochs` local epochs, so that a client's training (about 30 ms here)
outweighs its messages. Throughput is clients trained per second of steady round (rounds after
the second); the baseline is the one-learner run of the same job in the same run. The issue's
target: 8 learners at least 6x one, on a machine with 16 cores.
Prints one JSON object. Usage: python benchmarks/learner_scaling.py [--learners 1,2,4,8] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from round_overhead import on_rabbitmq  # noqa: E402 - its clock of job events, on real processes
from targets import emit  # noqa: E402 - benchmarks/, the script's own folder

from fedmq.common.jobspec import JobSpec, parse_job  # noqa: E402
from fedmq.common.logging import configure_logging  # noqa: E402


def job(clients: int, epochs: int, rounds: int) -> JobSpec:
    return parse_job({
        "name": "learner-scaling", "seed": 0,
        "task": {"name": "digits", "options": {"model": {"name": "mlp", "hidden": [512, 512]},
                                               "partition": {"kind": "iid"}}},
        "clients": {"total": clients, "per_round": clients, "min_fit": clients},
        "rounds": rounds,
        "train": {"epochs": epochs, "batch_size": 16, "lr": 0.01},
        "round_timeout_s": 600,
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--learners", default="1,2,4,8")
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    configure_logging("json", "warning")
    spec = job(args.clients, args.epochs, args.rounds)
    report: dict[str, Any] = {"benchmark": "learner_scaling", "cpus": os.cpu_count(),
                              "clients_per_round": args.clients, "epochs": args.epochs, "runs": {}}
    for learners in (int(n) for n in args.learners.split(",")):
        median = on_rabbitmq(spec, learners)["round_s_median"]  # steady rounds: after the second
        per_s = round(args.clients / median, 2)
        report["runs"][str(learners)] = {"round_s_median": median, "clients_per_s": per_s}
    first = report["runs"][args.learners.split(",")[0]]["clients_per_s"]
    for row in report["runs"].values():
        row["throughput_over_first"] = round(row["clients_per_s"] / first, 2)
    print(json.dumps(report, indent=2))
    runs, most = report["runs"], max(report["runs"], key=int)
    if "1" in runs:  # the goal: 8 learners against one, 40 clients a round, on 16 cores
        emit("learner_scaling", f"clients trained a second by {most} learner processes against by one, "
             f"RabbitMQ, {args.clients} clients a round", figure=runs[most]["clients_per_s"],
             baseline=runs["1"]["clients_per_s"], unit="clients a second", at_least=7.0,  # issue 33
             applies=most == "8" and args.clients == 40 and (os.cpu_count() or 0) >= 16,
             why_not="the goal is 8 learners against one, 40 clients a round, on 16 cores")


if __name__ == "__main__":
    main()
