"""FedPer and Ditto against FedAvg on a label-skewed split, judged on each client's own validation data.

The workload: scikit-learn's digits, an MLP 64-64-10, 20 clients with two label shards each
(`partition: shards`), a quarter of each client's examples kept as its own validation data,
10 clients a round, 2 local epochs of SGD (lr 0.05, batch 16), 40 rounds; every client evaluates
at the end. FedAvg's figure is its global model on each client's validation data
(`federated.accuracy`, example-weighted); FedPer's and Ditto's are each client's personal model on
the same data (`personal.accuracy`). Each method runs with --seeds seeds (default 3: 0, 1, 2).

Usage: python benchmarks/personalization.py [--seeds N] [--rounds R]
Prints one JSON object, then one target line per method (targets.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from targets import emit  # noqa: E402 - benchmarks/, the script's own folder

METHODS: dict[str, dict[str, Any] | None] = {
    "fedavg": None,
    "fedper": {"method": "fedper", "layers": ["3.*"]},  # the MLP's last Linear: each client's own head
    "ditto": {"method": "ditto", "lam": 0.1},
}


def spec(seed: int, rounds: int, personalize: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "name": "personalization", "seed": seed,
        "task": {"name": "digits", "options": {
            "model": {"name": "mlp", "hidden": [64]}, "own_validation": 0.25,
            "partition": {"kind": "shards", "shards_per_client": 2}}},
        "clients": {"total": 20, "per_round": 10},
        "rounds": rounds,
        "train": {"epochs": 2, "batch_size": 16, "lr": 0.05},
        "evaluate": {"every": rounds, "server": False, "federated": {"clients": 20}},
        **({"personalize": personalize} if personalize else {}),
    }


def accuracy(seed: int, rounds: int, method: str) -> tuple[float, float]:
    """The method's accuracy on the clients' own validation data, and the run's seconds."""
    from fedmq.common.jobspec import parse_job
    from fedmq.common.logging import configure_logging
    from fedmq.common.settings import Settings
    from fedmq.services.engine.run import run_job

    configure_logging("json", "warning")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as state:
        result = run_job(parse_job(spec(seed, rounds, METHODS[method])), Settings(state_dir=Path(state)))
    assert result["status"] == "completed", result.get("reason")
    metrics = result["history"][-1]["metrics"]
    source = "federated" if METHODS[method] is None else "personal"
    return float(metrics[source]["accuracy"]), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {method: [] for method in METHODS}
    seconds: dict[str, float] = {method: 0.0 for method in METHODS}
    for seed in range(args.seeds):
        for method in METHODS:
            acc, took = accuracy(seed, args.rounds, method)
            runs[method].append(round(acc, 4))
            seconds[method] += took
    out = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "own_validation_accuracy": runs,
        "mean": {m: round(statistics.mean(v), 4) for m, v in runs.items()},
        "seconds": {m: round(s, 1) for m, s in seconds.items()},
    }
    print(json.dumps(out, indent=2))
    baseline = statistics.mean(runs["fedavg"])
    for method in ("fedper", "ditto"):
        figure = statistics.mean(runs[method])
        emit(f"personalization_{method}", f"{method}'s personal models over FedAvg's global model, each "
             "client's own validation accuracy (mean over seeds)", figure=figure, baseline=baseline,
             unit="accuracy", at_least=1.0)


if __name__ == "__main__":
    main()
