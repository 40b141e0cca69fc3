"""Fused client training (fedmq.common.task.fused) vs the sequential loop, on the digits Task.

Both train every client of a round from the global weights with the same batches (each client's
generator seeded alike) and average with FedAvg in the same loop; only the training differs.
This measures the training kernel alone (benchmarks/fused_run.py measures `fedmq run`).
`--device cuda` trains both on a GPU (IEEE float32, no TF32), timed after a synchronize.
Prints one JSON object. Usage: python benchmarks/fused.py [--rounds N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fedmq.common.jobspec import load_job  # noqa: E402
from fedmq.common.task.contract import TrainContext, TrainSettings  # noqa: E402
from fedmq.common.task.fused import train_fused  # noqa: E402
from fedmq.common.task.loop import train_with_loss  # noqa: E402
from fedmq.common.task.runtime import TaskRuntime  # noqa: E402


def contexts(
    spec: Any, weights: dict[str, torch.Tensor], server_round: int, device: torch.device
) -> list[TrainContext]:
    t = spec.train
    settings = TrainSettings(epochs=t.epochs, batch_size=t.batch_size, optimizer=t.optimizer, lr=t.lr,
                             momentum=t.momentum, weight_decay=t.weight_decay)
    return [
        TrainContext(client=c, round=server_round, seed=spec.seed, train=settings, device=device,
                     generator=torch.Generator().manual_seed(spec.seed * 1_000_003 + server_round * 1009 + c),
                     global_weights=weights)
        for c in range(spec.clients.total)
    ]


def fedavg(states: list[dict[str, torch.Tensor]], counts: list[int]) -> dict[str, torch.Tensor]:
    total = sum(counts)
    return {n: sum(s[n] * (k / total) for s, k in zip(states, counts, strict=True)) for n in states[0]}  # type: ignore[misc]


def run(clients: int, epochs: int, rounds: int, fused: bool, device: torch.device) -> dict[str, Any]:
    spec = load_job(REPO / "examples" / "digits.yaml", {
        "clients.total": clients, "clients.per_round": clients, "clients.min_fit": 1, "train.epochs": epochs,
    })
    runtime = TaskRuntime.for_job(spec)
    model = runtime.build_model().to(device)
    data = [runtime.load_data(c, None).train for c in range(clients)]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    seconds = []
    for r in range(1, rounds + 1):
        started = time.perf_counter()
        ctxs = contexts(spec, weights, r, device)
        if fused:
            model.load_state_dict(weights)
            out = train_fused(runtime.task, model, data, ctxs)
            assert out is not None, "digits should fuse"
            states, counts = [o.weights for o in out], [o.result.num_examples for o in out]
        else:
            states, counts = [], []
            for ctx, d in zip(ctxs, data, strict=True):
                model.load_state_dict(weights)
                result = train_with_loss(runtime.task, model, d, ctx)
                states.append({n: p.detach().clone() for n, p in model.named_parameters()})
                counts.append(result.num_examples)
        weights = fedavg(states, counts)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    steady = seconds[1:]
    return {"round_s_median": statistics.median(steady), "round_s_first": seconds[0], "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    report: dict[str, Any] = {"benchmark": "fused", "device": _describe(device), "cpus": os.cpu_count(),
                              "rounds": args.rounds, "cases": {}}
    # about 5 local SGD steps per client at both sizes (batch 32, Dirichlet-skewed clients)
    for clients, epochs in ((10, 1), (100, 5)):
        plain = run(clients, epochs, args.rounds, fused=False, device=device)
        fused = run(clients, epochs, args.rounds, fused=True, device=device)
        gap = max(float((plain["weights"][n] - fused["weights"][n]).abs().max()) for n in plain["weights"])
        report["cases"][f"{clients}_clients_per_round"] = {
            "epochs": epochs,
            "sequential_loop_baseline_round_s": plain["round_s_median"],
            "fused_round_s": fused["round_s_median"],
            "fused_over_sequential": fused["round_s_median"] / plain["round_s_median"],
            "max_weight_gap_after_all_rounds": gap,
        }
    print(json.dumps(report, indent=2))


def _describe(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
