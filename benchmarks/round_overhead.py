"""Orchestration cost per round: 1 SGD step per client, 10 clients a round (--clients), 3 learners.

Measures, on RabbitMQ (real service processes) and on the in-memory bus (one process):
the steady per-round time, and the time from submitting a job to its first round
starting. The same job run as a plain single-process loop (tests/reference.py) is
the baseline measured in the same run: what is left is fedmq's own overhead. On RabbitMQ it also
gives the CPU time each process (and a local broker) spent a steady round, which a shared
machine's load changes far less than the round's time.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from broker_floor import floor  # noqa: E402 - benchmarks/, the script's own folder
from targets import emit  # noqa: E402

from fedmq.common.jobspec import JobSpec, load_job  # noqa: E402
from fedmq.common.logging import configure_logging  # noqa: E402
from fedmq.common.messages import JobEvent, JobSubmit  # noqa: E402
from fedmq.common.settings import Settings  # noqa: E402
from fedmq.services.cli.embedded import new_job_id, run_job  # noqa: E402
from fedmq.services.cli.remote import Remote  # noqa: E402
from tests.e2e.cluster import cluster  # noqa: E402
from tests.rabbit import fresh_vhost  # noqa: E402
from tests.reference import reference_fedavg  # noqa: E402

# The goals at 10 and at 100 clients a round (issue 16's; RabbitMQ's at 100 as issue 33 set it):
# the round over the plain loop's, each bus; at 10, also the overhead of one client update (seconds).
ROUND_GOALS = {10: {"rabbitmq": 3.0, "in_memory": 1.5}, 100: {"rabbitmq": 2.0, "in_memory": 1.5}}
UPDATE_GOALS_S = {"rabbitmq": 0.0015, "in_memory": 0.0005}


class Clock:
    """Arrival time of each job event, relative to submission."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.round_started: dict[int, float] = {}
        self.done = threading.Event()

    def __call__(self, event: JobEvent) -> None:
        now = time.perf_counter() - self.t0
        if event.kind == "round_started" and event.round is not None:
            self.round_started[event.round] = now
        elif event.kind in ("completed", "failed", "cancelled"):
            self.round_started[-1] = now
            self.done.set()

    def figures(self, rounds: int) -> dict[str, Any]:
        starts = [self.round_started[r] for r in range(1, rounds + 1)] + [self.round_started[-1]]
        per_round = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        steady = per_round[2:]  # the first rounds warm caches and torch up
        return {
            "submit_to_first_round_s": round(starts[0], 3),
            "round_s_median": round(statistics.median(steady), 4),
            "round_s_p90": round(sorted(steady)[int(0.9 * (len(steady) - 1))], 4),
            "rounds_measured": len(steady),
        }


def on_rabbitmq(spec: JobSpec, learners: int) -> dict[str, Any]:
    """The figures, and the CPU each process spent a steady round (from round 3's start to the end;
    the broker's too, when it runs on this machine): where a round's time goes on a busy machine.
    Also the broker's floor (broker_floor.py): the same round's messages over bare pika, on the
    same broker and vhost, before fedmq's services start; and that floor with the plain loop's
    training and a fold and fsync a round in the same processes (what this machine allows the
    layout, with no fedmq code)."""
    with fresh_vhost() as url:
        bare = floor(url, spec.clients.sampled, learners, spec.rounds)
        trained = floor(url, spec.clients.sampled, learners, spec.rounds, train=True)
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), learners=learners) as c:
        c.wait_learners(learners)
        settings = Settings(broker_url=c.url, state_dir=Path(tmp) / "cli")
        pids = {name: proc.pid for name, proc in c.procs.items()} | local_broker()
        with Remote(settings) as remote:
            job_id = new_job_id(spec)
            follower = remote.follow(job_id)
            clock = Clock()
            remote.send(JobSubmit(job_id=job_id, spec=spec.model_dump(mode="json")))
            before: dict[str, float] = {}
            for event in follower.events(idle_timeout=120):
                clock(event)
                if event.kind == "round_started" and event.round == 3:
                    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        c.stop_all()
    figures = clock.figures(spec.rounds) | {"broker_floor_round_s_median": bare["round_s_median"],
                                            "broker_floor_trained_round_s_median": trained["round_s_median"]}
    steady = spec.rounds - 2
    if before and steady > 0:
        spent = {name: round(1000 * (after[name] - before[name]) / steady, 1) for name in pids}
        figures["cpu_ms_a_round"] = spent | {"all": round(sum(spent.values()), 1)}
    return figures


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def local_broker() -> dict[str, int]:
    """The RabbitMQ node's process on this machine, if one runs here (its Erlang VM)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"beam.smp" in command and b"rabbit" in command:
            return {"rabbitmq": int(proc.name)}
    return {}


def in_memory(spec: JobSpec, learners: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        clock = Clock()
        run_job(spec, Settings(state_dir=Path(tmp)), learners=learners, on_event=clock)
    return clock.figures(spec.rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--clients", type=int, default=10, help="clients a round (all of the job's)")
    args = parser.parse_args()
    configure_logging("json", "warning")
    spec = load_job(REPO / "examples" / "digits.yaml", {
        "rounds": args.rounds, "train.max_steps": 1, "clients.total": args.clients,
        "clients.per_round": args.clients, "clients.min_fit": args.clients,
    })
    plain = reference_fedavg(spec)["round_seconds"][2:]
    report = {
        "job": "examples/digits.yaml with train.max_steps=1",
        "clients_per_round": spec.clients.sampled,
        "learners": args.learners,
        "plain_loop_baseline_round_s_median": round(statistics.median(plain), 4),
        "rabbitmq": on_rabbitmq(spec, args.learners),
        "in_memory": in_memory(spec, args.learners),
    }
    # The plain loop's round against what the broker alone allows: a goal under it is out of reach.
    for name in ("broker_floor", "broker_floor_trained"):
        report["rabbitmq"][f"{name}_over_plain_loop"] = round(
            report["rabbitmq"][f"{name}_round_s_median"] / report["plain_loop_baseline_round_s_median"], 2
        )
    for bus in ("rabbitmq", "in_memory"):
        report[bus]["overhead_per_round_s"] = round(
            report[bus]["round_s_median"] - report["plain_loop_baseline_round_s_median"], 4
        )
    print(json.dumps(report, indent=2))
    emit_targets(report, spec.clients.sampled)


def emit_targets(report: dict[str, Any], clients: int) -> None:
    """The target lines: each bus's steady round over the plain loop; at 10 clients, per update.
    None at a count of clients no goal names (as learner_scaling prints none without one learner)."""
    plain = report["plain_loop_baseline_round_s_median"]
    goals = ROUND_GOALS.get(clients)
    if goals is None:
        return
    for bus in ("rabbitmq", "in_memory"):
        emit(f"round_{clients}_clients_{bus}",
             f"steady round, {clients} clients a round, 1 SGD step each, {bus} / the plain loop",
             figure=report[bus]["round_s_median"], baseline=plain, unit="s a round", at_most=goals[bus])
        if clients == 10:
            emit(f"overhead_per_update_{bus}",
                 f"(round - plain loop's round) / clients, {bus}; baseline: the plain loop's time a client",
                 figure=report[bus]["overhead_per_round_s"] / clients, baseline=plain / clients,
                 unit="s an update", at_most=UPDATE_GOALS_S[bus], on="figure")


if __name__ == "__main__":
    main()
