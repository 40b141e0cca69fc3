"""Memory of SCAFFOLD's round close: the aggregator's RSS growth with few and with many clients.

Writes k ClientUpdates (weights and ``dc.<param>`` extras) of a ~40 MB model into an aggregator
JobStore as the aggregator spools them, and each client's c_i of an earlier round into its
ClientStore. Then, in a fresh child process per k, holds the global model (as an aggregator
does), takes its RSS as the baseline and runs what close_round runs: Scaffold.aggregate over the
lazily read updates, then write_client_states (each client's c_i⁺ made, checked and written in
turn). Per-client state lives on disk, so the growth should stay about flat as k grows: the
mean of the weights, the mean of dc, c, the new weights and one client's c_i and c_i⁺, whatever k.
Prints one JSON object with the growth for each k and the ratio of the largest k's to the smallest's.

Usage: python benchmarks/scaffold_memory.py [--clients 4,16] [--width 1024] [--depth 10]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fedmq.common.messages import ClientUpdate, to_wire  # noqa: E402
from fedmq.common.strategy.clients import ClientStore  # noqa: E402
from fedmq.common.strategy.contract import RoundContext  # noqa: E402
from fedmq.common.task.scaffold import CLIENT, DELTA  # noqa: E402
from fedmq.services.aggregator.rounds import client_results, write_client_states  # noqa: E402
from fedmq.services.aggregator.store import JobStore  # noqa: E402
from fedmq.services.aggregator.strategies.scaffold import Scaffold  # noqa: E402

MiB = 1024 * 1024
JOB, ROUND = "scaffold-memory", 2


def rss_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match, field
    return int(match.group(1)) * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs), so the peak is the round's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def model_state(width: int, depth: int) -> dict[str, torch.Tensor]:
    """An MLP-shaped state dict: depth layers of width × width weights and their biases."""
    g = torch.Generator().manual_seed(0)
    state = {}
    for layer in range(depth):
        state[f"l{layer}.weight"] = torch.randn(width, width, generator=g) * 0.01
        state[f"l{layer}.bias"] = torch.zeros(width)
    return state


def write_round(root: Path, state: dict[str, torch.Tensor], clients: int) -> None:
    """The round's spooled updates, and each client's c_i kept from round 1."""
    store, kept = JobStore(root, JOB), ClientStore(root / JOB / "clients")
    for client in range(clients):
        g = torch.Generator().manual_seed(client)
        weights = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in state.items()}
        extras = {DELTA + n: 0.01 * torch.randn(t.shape, generator=g) for n, t in state.items()}
        message = ClientUpdate(
            job_id=JOB, task_id=f"t{client}", round=ROUND, client=client, base_digest="00" * 32,
            num_examples=100, weights=weights, extras=extras,
        )
        store.put_update(ROUND, client, to_wire(message))
        own = {CLIENT + n: 0.1 * torch.randn(t.shape, generator=g) for n, t in state.items()}
        kept.write(ROUND - 1, client, own)
        del weights, extras, message, own
        gc.collect()


def measure(root: Path, width: int, depth: int) -> dict[str, object]:
    """In a fresh process: the global model held, RSS growth while SCAFFOLD closes the round."""
    current = model_state(width, depth)
    store, kept = JobStore(root, JOB), ClientStore(root / JOB / "clients")
    clients = store.stored_clients(ROUND)
    gc.collect()
    baseline = rss_bytes("VmRSS")
    reset = reset_peak()
    started = time.perf_counter()
    results = client_results(store, ROUND, clients, current)
    ctx = RoundContext(round=ROUND, rounds=ROUND, seed=0, num_clients=len(clients), clients=tuple(clients),
                       reader=lambda c: kept.read(c, before=ROUND))
    out = Scaffold().aggregate(ctx, current, results, [])
    written = write_client_states(kept, ROUND, out.client_state, out.shared_state)
    seconds = time.perf_counter() - started
    peak = rss_bytes("VmHWM")
    assert written == clients and out.weights.keys() == current.keys()
    return {"clients": len(clients), "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
            "rss_growth_bytes": peak - baseline, "seconds": round(seconds, 2), "peak_reset": reset}


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--clients", default="4,16")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.root), args.width, args.depth)))
        return
    state = model_state(args.width, args.depth)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    for k in (int(n) for n in args.clients.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            write_round(Path(tmp), state, k)
            child = subprocess.run(
                [sys.executable, __file__, "--measure", "--root", tmp,
                 "--width", str(args.width), "--depth", str(args.depth)],
                capture_output=True, text=True, check=False,
            )
            if child.returncode != 0:
                raise SystemExit(f"{k} clients failed:\n{child.stderr[-3000:]}")
            row = json.loads(child.stdout.splitlines()[-1])
            growth = int(row["rss_growth_bytes"])
            models = round(growth / model_bytes, 2)
            rows.append(row | {"rss_growth_mib": round(growth / MiB, 1), "models": models})
    report = {
        "model_mib": round(model_bytes / MiB, 1),
        "runs": rows,
        "growth_ratio_most_to_fewest_clients": round(
            int(rows[-1]["rss_growth_bytes"]) / max(int(rows[0]["rss_growth_bytes"]), 1), 2
        ),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
