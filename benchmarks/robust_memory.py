"""Memory of robust aggregation: coordinate median over k spooled updates of the ~200 MB model.

Builds the model of benchmarks/large_model.py (examples.plugins.big_mlp), writes k
perturbed ClientUpdates into an aggregator JobStore as the aggregator spools them,
then runs each kernel in a fresh child process over the lazily read files
(JobStore.read_update -> TensorFile). Each child first builds the global model
(which an aggregator holds anyway), takes its RSS as the baseline, then reports
its peak RSS while aggregating. weighted_mean (FedAvg's streaming fold) over the
same files is the baseline kernel, measured in the same run. Prints one JSON object;
the target is median's RSS growth under 2x the model.

Usage: python benchmarks/robust_memory.py [--width 2048] [--depth 13] [--clients 20]
       [--kernels median,weighted_mean]
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

from examples.plugins.big_mlp import build  # noqa: E402
from fedmq.common.messages import ClientUpdate, to_wire  # noqa: E402
from fedmq.services.aggregator.kernels import robust  # noqa: E402
from fedmq.services.aggregator.kernels.mean import weighted_mean  # noqa: E402
from fedmq.services.aggregator.store import JobStore  # noqa: E402

MiB = 1024 * 1024
JOB, ROUND = "robust-memory", 1
KERNELS = {
    "median": lambda updates: robust.coordinate_median(updates),
    "trimmed_mean": lambda updates: robust.trimmed_mean(updates, 0.2),
    "krum": lambda updates: robust.krum(updates, 1, 2)[0],
    "weighted_mean": lambda updates: weighted_mean((u, 1.0) for u in updates),
}


def rss_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match, field
    return int(match.group(1)) * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs), so the peak is the kernel's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def model_state(width: int, depth: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: t.detach() for name, t in build((64,), 10, width=width, depth=depth).state_dict().items()}


def write_updates(root: Path, state: dict[str, torch.Tensor], clients: int) -> None:
    store = JobStore(root, JOB)
    for client in range(clients):
        generator = torch.Generator().manual_seed(client)
        weights = {n: t + 0.01 * torch.randn(t.shape, generator=generator) for n, t in state.items()}
        message = ClientUpdate(
            job_id=JOB, task_id=f"t{client}", round=ROUND, client=client, base_digest="00" * 32,
            num_examples=100, weights=weights,
        )
        store.put_update(ROUND, client, to_wire(message))
        del weights, message
        gc.collect()


def measure(root: Path, kernel: str, width: int, depth: int) -> dict[str, object]:
    """In a fresh process: the global model built, RSS growth while `kernel` runs over the spooled files."""
    global_model = model_state(width, depth)
    gc.collect()
    baseline = rss_bytes("VmRSS")
    reset = reset_peak()
    store = JobStore(root, JOB)
    updates = [store.read_update(ROUND, c) for c in store.stored_clients(ROUND)]
    started = time.perf_counter()
    out = KERNELS[kernel](updates)
    seconds = time.perf_counter() - started
    peak = rss_bytes("VmHWM")
    assert out.keys() == global_model.keys()
    return {"kernel": kernel, "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
            "rss_growth_bytes": peak - baseline, "seconds": round(seconds, 2), "peak_reset": reset}


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=13)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--kernels", default="median,weighted_mean")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # child mode: one kernel over --root
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.root), args.measure, args.width, args.depth)))
        return
    state = model_state(args.width, args.depth)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_updates(Path(tmp), state, args.clients)
        del state
        for kernel in args.kernels.split(","):
            child = subprocess.run(
                [sys.executable, __file__, "--measure", kernel, "--root", tmp,
                 "--width", str(args.width), "--depth", str(args.depth)],
                capture_output=True, text=True, check=False,
            )
            if child.returncode != 0:
                raise SystemExit(f"{kernel} failed:\n{child.stderr[-3000:]}")
            results[kernel] = json.loads(child.stdout.splitlines()[-1])
    report: dict[str, object] = {
        "model_bytes": model_bytes,
        "model_mib": round(model_bytes / MiB, 1),
        "largest_tensor_mib": round(largest / MiB, 1),
        "clients": args.clients,
        "chunk_mib": robust.CHUNK_BYTES / MiB,
    }
    for kernel, row in results.items():
        growth = int(row["rss_growth_bytes"])
        ratio = round(growth / model_bytes, 2)
        report[kernel] = row | {"rss_growth_mib": round(growth / MiB, 1), "ratio": ratio}
    if "median" in results:
        growth = int(results["median"]["rss_growth_bytes"])
        report |= {"rss_growth_bytes": growth, "ratio": round(growth / model_bytes, 2),
                   "seconds": results["median"]["seconds"], "under_2x_model": growth < 2 * model_bytes}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
