"""Time the FedOpt and DP-FedAvg kernels against FedAvg's weighted mean of the same round.

Run from the repo root: ``.venv/bin/python benchmarks/server_kernels.py``. Prints one JSON object.
The baseline is ``weighted_mean`` over the round's k client states, measured in the same run:
``fedopt_<variant>_vs_mean`` is the extra server step's time over the mean's (FedOpt runs after
the mean, so a FedOpt round costs 1 + that), ``dp_fedavg_vs_mean`` is a whole DP round (delta,
norm, clip, mean, noise) over the mean's. ``epsilon_*`` time the accountant: the first call of
a process imports Opacus and computes one round's RDP, later rounds reuse it.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fedmq.common.privacy import epsilon  # noqa: E402
from fedmq.services.aggregator.kernels.adaptive import VARIANTS, fedopt_step  # noqa: E402
from fedmq.services.aggregator.kernels.mean import weighted_mean  # noqa: E402
from fedmq.services.aggregator.kernels.private import adaptive_dp_fedavg, dp_fedavg  # noqa: E402


def best_seconds(action: Callable[[], Any], repeats: int) -> float:
    """Best wall time of repeats runs after one warm-up; results are freed outside the timing."""
    action()
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        result = action()
        elapsed = time.perf_counter() - start
        del result
        best = min(best, elapsed)
    return best


def once_seconds(action: Callable[[], Any]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> None:
    """Build a model and a round of client states, time each kernel and print the JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="model size in MiB of float32")
    parser.add_argument("--tensors", type=int, default=8, help="number of equal tensors")
    parser.add_argument("--clients", type=int, default=10, help="client states in the round")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; the best is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a busy host)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    numel = args.mib * 1024**2 // 4 // args.tensors
    g = torch.Generator().manual_seed(0)
    current = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(args.tensors)}
    clients = [
        {name: t + 0.01 * torch.randn(t.shape, generator=g) for name, t in current.items()}
        for _ in range(args.clients)
    ]
    averaged = weighted_mean((c, 1.0) for c in clients)
    _, m, v = fedopt_step(
        current, averaged, None, None, variant="adam", eta=0.01, beta1=0.9, beta2=0.99, tau=1e-3
    )

    timings: dict[str, float] = {
        "mean": best_seconds(lambda: weighted_mean((c, 1.0) for c in clients), args.repeats),
    }
    for variant in VARIANTS:
        timings[f"fedopt_{variant}"] = best_seconds(
            lambda variant=variant: fedopt_step(  # type: ignore[misc]
                current, averaged, m, v, variant=variant, eta=0.01, beta1=0.9, beta2=0.99, tau=1e-3
            ),
            args.repeats,
        )
    timings["dp_fedavg"] = best_seconds(
        lambda: dp_fedavg(
            current, clients, clip_norm=1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(1)
        ),
        args.repeats,
    )
    timings["adaptive_dp_fedavg"] = best_seconds(
        lambda: adaptive_dp_fedavg(
            current,
            clients,
            clip_norm=1.0,
            noise_multiplier=1.0,
            count_noise_std=args.clients / 20 + 0.5,
            target_quantile=0.5,
            clip_learning_rate=0.2,
            generator=torch.Generator().manual_seed(1),
        ),
        args.repeats,
    )
    epsilon_first = once_seconds(lambda: epsilon(1.1, 0.1, 1, 1e-5))
    epsilon_later = best_seconds(lambda: epsilon(1.1, 0.1, 100, 1e-5), args.repeats)

    report: dict[str, Any] = {
        "model_bytes": sum(t.numel() * t.element_size() for t in current.values()),
        "tensors": args.tensors,
        "clients": args.clients,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "baseline": "weighted_mean over the round's client states",
    }
    for name, seconds in timings.items():
        report[f"{name}_s"] = round(seconds, 6)
    for name in timings:
        if name != "mean":
            report[f"{name}_vs_mean"] = round(timings[name] / timings["mean"], 3)
    report["epsilon_first_call_s"] = round(epsilon_first, 4)
    report["epsilon_later_call_s"] = round(epsilon_later, 6)
    report["epsilon_100_rounds_z1.1_q0.1_delta1e-5"] = round(epsilon(1.1, 0.1, 100, 1e-5), 4)
    report["versions"] = {"python": platform.python_version(), "torch": torch.__version__}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
