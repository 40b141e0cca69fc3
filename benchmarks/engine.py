"""`fedmq run`'s engine against a plain sequential FedAvg loop, in the same run (issue 30's targets).

The workload: scikit-learn's digits, an MLP 64-128-10, 100 IID clients (~14 training examples
each), SGD lr 0.05, batch 32, FedAvg weighted by examples, server evaluation every round, one
torch thread. Each side runs in a process of its own (its peak RSS is its own):

    engine    fedmq's in-process engine (services/engine) on the digits Task, as `fedmq run` runs it
    loop      a plain loop a researcher writes in an afternoon: each client's data loaded once, then
              per round load the global weights, train with torch.optim.SGD, average, evaluate
    reference the independent loop and the clients-trained-together script of
              ../shared/reference/clients_together, when that folder is there (--reference DIR)

A round's time is the gap between two rounds' ends (evaluation included); steady: the median of
rounds 2..R. One epoch of a ~14-example client is one SGD step: "one step" below. Each side runs
--repeat times (default 2), interleaved with the others, and its fastest steady round counts:
this shared 2-core machine moved one run's figures by up to 40 %. The JSON also gives each
repeat's ratio to the loop's run beside it (`paired_ratios`) and their median.

Usage: python benchmarks/engine.py [--cases NAME,...] [--reference DIR]
Prints one JSON object, then one target line per goal (targets.py).
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

from targets import emit  # noqa: E402 - benchmarks/, the script's own folder

CLIENTS = 100
# name: (clients a round, local epochs, rounds)
CASES: dict[str, tuple[int, int, int]] = {
    "one_step_10": (10, 1, 40),
    "one_step_100": (100, 1, 12),
    "epochs5_10": (10, 5, 20),
    "epochs5_100": (100, 5, 8),
    "long_300": (10, 1, 300),
}
GOALS: dict[str, dict[str, float]] = {  # the engine's steady round over the loop's, at most
    "one_step_10": {"fused": 1.2},
    "one_step_100": {"fused": 1.2},
    "epochs5_10": {"fused": 0.6, "unfused": 1.1},
    "epochs5_100": {"fused": 0.3, "unfused": 1.1},
}
RSS_GOAL = 1.2
LONG_GOAL = 1.05
DEFAULT_REFERENCE = REPO.parent / "shared" / "reference" / "clients_together"


def spec(case: str, fuse: bool) -> dict[str, Any]:
    per_round, epochs, rounds = CASES[case]
    return {
        "name": f"bench-{case}", "seed": 0,
        "task": {"name": "digits", "options": {
            "model": {"name": "mlp", "hidden": [128]}, "test_fraction": 0.2, "partition": {"kind": "iid"}}},
        "clients": {"total": CLIENTS, "per_round": per_round},
        "rounds": rounds,
        "train": {"epochs": epochs, "batch_size": 32, "optimizer": "sgd", "lr": 0.05,
                  **({} if fuse else {"fuse": False})},
        "strategy": {"name": "fedavg"},
    }


# -- the children ---------------------------------------------------------------------------


def child_engine(case: str, fuse: bool) -> dict[str, Any]:
    from fedmq.common.jobspec import parse_job
    from fedmq.common.logging import configure_logging
    from fedmq.common.settings import Settings
    from fedmq.services.engine.run import run_job

    configure_logging("auto", "warning")  # as `fedmq run` does
    ends: list[float] = []
    with tempfile.TemporaryDirectory() as state:
        result = run_job(parse_job(spec(case, fuse)), Settings(state_dir=Path(state), torch_threads=1),
                         on_event=lambda e: ends.append(time.perf_counter()) if e.kind == "round_completed"
                         else None)
    assert result["status"] == "completed", result.get("reason")
    return {"rounds": [b - a for a, b in zip(ends, ends[1:], strict=False)],
            "fused_groups": len(result["fused_groups"]),
            "accuracy": result["history"][-1]["metrics"]["server"]["accuracy"]}


def child_loop(case: str) -> dict[str, Any]:
    """The plain loop: the digits Task's data and model (the same problem), everything else plain torch."""
    import torch
    from torch import nn

    from fedmq.common.jobspec import parse_job
    from fedmq.common.seeding import torch_generator
    from fedmq.common.task.runtime import TaskRuntime
    from fedmq.services.scheduler.sampling import sample_clients

    torch.set_num_threads(1)
    job = parse_job(spec(case, True))
    task = TaskRuntime.for_job(job)
    model = task.build_model()
    data = [task.load_data(k, None).train for k in range(CLIENTS)]
    x_test, y_test = task.load_server_data(None)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    per_round, epochs, rounds = CASES[case]
    times, accuracy = [], 0.0
    for r in range(1, rounds + 1):
        started = time.perf_counter()
        total: dict[str, torch.Tensor] = {}
        seen = 0
        for k in sample_clients(job.seed, r, CLIENTS, per_round):
            x, y = data[k]
            model.load_state_dict(glob)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            generator = torch_generator(job.seed, "train", r, k)
            for _ in range(epochs):
                for batch in torch.randperm(len(y), generator=generator).split(32):
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                    opt.step()
            for name, value in model.state_dict().items():
                total[name] = total[name] + len(y) * value if name in total else len(y) * value
            seen += len(y)
        glob = {name: value / seen for name, value in total.items()}
        model.load_state_dict(glob)
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
        times.append(time.perf_counter() - started)
    return {"rounds": times[1:], "accuracy": accuracy}


# -- the parent -----------------------------------------------------------------------------


def run_child(*args: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                         env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_reference(folder: Path, script: str, case: str) -> dict[str, Any] | None:
    """The independent scripts (fedavg_local.py, fedavg_vmap.py), IID as `--alpha 1000` there."""
    if not (folder / script).is_file():
        return None
    per_round, epochs, rounds = CASES[case]
    cmd = [sys.executable, script, "--num-clients", str(CLIENTS), "--clients-per-round", str(per_round),
           "--rounds", str(rounds), "--epochs", str(epochs), "--alpha", "1000"]
    out = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = out.stdout.splitlines()
    rounds_s = [float(line.split("round_s=")[1].split()[0]) for line in lines if line.startswith("ROUND")]
    if out.returncode != 0 or len(rounds_s) < 2:
        return {"error": out.stderr[-500:]}
    return {"steady_s": statistics.median(rounds_s[1:]), "rounds": len(rounds_s)}


def steady(report: dict[str, Any]) -> float:
    return statistics.median(report["rounds"][1:] if len(report["rounds"]) > 2 else report["rounds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs of each side, interleaved; each side's fastest steady round counts")
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        kind, case, *rest = args.child
        report = child_engine(case, fuse=rest != ["unfused"]) if kind == "engine" else child_loop(case)
        report["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(report))
        return
    cases = [c for c in args.cases.split(",") if c]
    out: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(), "cases": {}}
    lines = []
    for case in cases:
        sides: dict[str, tuple[str, ...]] = {"loop": ("loop", case), "fused": ("engine", case)}
        if case in GOALS and "unfused" in GOALS[case]:
            sides["unfused"] = ("engine", case, "unfused")
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        for _ in range(max(1, args.repeat)):  # interleaved: a burst of load on the machine hits each side
            for name, child in sides.items():
                runs[name].append(run_child(*child))
        row: dict[str, Any] = {name: min(reports, key=steady) for name, reports in runs.items()}
        # Each repeat's fedmq run over the loop's run beside it: on a noisy machine, their median says
        # more than the fastest of each side (a burst of load hits a pair's two runs alike).
        paired = {name: sorted(round(steady(mine) / steady(loop), 3)
                               for mine, loop in zip(reports, runs["loop"], strict=True))
                  for name, reports in runs.items() if name != "loop"}
        for script in ("fedavg_local.py", "fedavg_vmap.py") if case != "long_300" else ():
            if (found := run_reference(args.reference, script, case)) is not None:
                row[script] = found
        summary = {name: round(steady(r), 5) for name, r in row.items() if "rounds" in r and name in
                   ("loop", "fused", "unfused")}
        summary |= {name: round(r["steady_s"], 5) for name, r in row.items() if "steady_s" in r}
        out["cases"][case] = {"steady_s": summary,
                              "paired_ratios": {n: {"each": r, "median": statistics.median(r)}
                                                for n, r in paired.items()},
                              "maxrss_mib": {n: round(r["maxrss_kib"] / 1024, 1) for n, r in row.items()
                                             if "maxrss_kib" in r},
                              "accuracy": {n: round(r["accuracy"], 4) for n, r in row.items()
                                           if "accuracy" in r}}
        for kind, goal in GOALS.get(case, {}).items():
            lines.append(dict(target=f"engine_{case}_{kind}",
                              what=f"fedmq run ({kind}), steady round over a plain loop's, {case}",
                              figure=steady(row[kind]), baseline=steady(row["loop"]), unit="s a round",
                              at_most=goal))
        if case == "epochs5_10":
            lines.append(dict(target="engine_peak_rss", what="peak RSS of fedmq run over the plain loop's",
                              figure=row["fused"]["maxrss_kib"] / 1024,
                              baseline=row["loop"]["maxrss_kib"] / 1024,
                              unit="MiB", at_most=RSS_GOAL))
        if case == "long_300":
            times = row["fused"]["rounds"]  # gaps: rounds 2..300 (index i is round i + 2)
            early, late = statistics.median(times[8:29]), statistics.median(times[-20:])
            lines.append(dict(target="engine_long_job",
                              what="last 20 rounds over rounds 10-30, a 300-round job",
                              figure=late, baseline=early, unit="s a round", at_most=LONG_GOAL))
    print(json.dumps(out, indent=2), flush=True)
    for line in lines:
        emit(**line)


if __name__ == "__main__":
    main()
