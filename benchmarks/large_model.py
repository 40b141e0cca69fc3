"""A ~200 MB model through a full round on RabbitMQ: chunking, frame sizes and aggregator memory.

Starts real scheduler, aggregator and learner processes on a fresh vhost, runs one
round of 4 clients (1 SGD step each) with the default 4 MiB frame, and reports the
aggregator's resident memory: its baseline (torch loaded, before the job) and its
peak (VmHWM) during the round, against the model size. Prints one JSON object.

Usage: python benchmarks/large_model.py [--width 2048] [--depth 13] [--learners 2]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e.cluster import cluster  # noqa: E402

MiB = 1024 * 1024


def rss_kib(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert match, field
    return int(match.group(1))


def bus_stats(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if '"bus_stats"' in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=13)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    width, depth = args.width, args.depth
    params = 64 * width + (depth - 1) * width**2 + width * 10 + width * depth + 10
    model_bytes = params * 4
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = root / "big.yaml"
        spec.write_text(json.dumps({
            "name": "big-model",
            "seed": 0,
            # The built-in digits Task with examples/plugins/big_mlp.py's model: an MLP of
            # `depth` hidden layers of `width`.
            "task": {"name": "digits", "options": {
                "model": {"name": "mlp", "hidden": [args.width] * args.depth},
                "partition": {"kind": "iid"}}},
            "clients": {"total": args.clients},
            "rounds": 1,
            "train": {"max_steps": 1, "lr": 0.01},
            "round_timeout_s": 1200,
        }))
        with cluster(root, learners=args.learners, FEDMQ_REQUEST_TIMEOUT_S="600") as c:
            c.wait_learners(args.learners)
            agg = c.procs["aggregator"].pid
            baseline = rss_kib(agg, "VmRSS")
            learners = [c.procs[f"learner-{i}"].pid for i in range(args.learners)]
            learner_baselines = [rss_kib(pid, "VmRSS") for pid in learners]
            started = time.perf_counter()
            submitted = c.fedmq("submit", str(spec), "--watch", timeout=1800)
            wall = time.perf_counter() - started
            peak = rss_kib(agg, "VmHWM")
            learner_peaks = [rss_kib(pid, "VmHWM") for pid in learners]
            codes = c.stop_all()
            stats = {name: bus_stats(c.log(name)) for name in c.procs}
        if submitted.returncode != 0:
            print(submitted.stderr[-3000:], file=sys.stderr)
            print(c.log("aggregator")[-3000:], file=sys.stderr)
            raise SystemExit("the round did not complete")
    frame = 4 * MiB
    largest = max(s["largest_frame_bytes"] for rows in stats.values() for s in rows)
    growth = (peak - baseline) * 1024
    print(json.dumps({
        "model_mib": round(model_bytes / MiB, 1),
        "tensors": 2 * (args.depth + 1),
        "clients_in_round": args.clients,
        "learners": args.learners,
        "frame_limit_mib": frame / MiB,
        "largest_broker_message_mib": round(largest / MiB, 3),
        "every_message_within_frame": largest <= frame,
        "blobs_sent": {n: sum(s["blobs_sent"] for s in rows) for n, rows in stats.items()},
        "aggregator_baseline_rss_mib": round(baseline / 1024, 1),
        "aggregator_peak_rss_mib": round(peak / 1024, 1),
        "aggregator_growth_mib": round(growth / MiB, 1),
        "aggregator_growth_vs_model": round(growth / model_bytes, 2),
        "aggregator_peak_vs_model": round(peak * 1024 / model_bytes, 2),
        "learner_baseline_rss_mib": [round(b / 1024, 1) for b in learner_baselines],
        "learner_peak_rss_mib": [round(p / 1024, 1) for p in learner_peaks],
        "learner_growth_vs_model": [
            round((peak - idle) * 1024 / model_bytes, 2)
            for idle, peak in zip(learner_baselines, learner_peaks, strict=True)
        ],
        "submit_to_done_s": round(wall, 1),
        "clean_exit": all(code == 0 for code in codes.values()),
    }, indent=2))


if __name__ == "__main__":
    main()
