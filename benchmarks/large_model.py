"""A ~200 MB model through a full round on RabbitMQ: chunking, frame sizes and aggregator memory.

Starts real scheduler, aggregator and learner processes on a fresh vhost, runs one
round of 4 clients (1 SGD step each) with the default 4 MiB frame, and reports the
aggregator's and each learner's resident memory: the idle baseline (torch loaded, before
any job), the warm idle (after a one-round job with a tiny model of the same Task, which
imports the data stack and loads the digits data), and the peak (VmHWM) through the big
model's round; the peak's growth over each against the model size. Prints one JSON object.

With --shared-models the learners share the models they fetch through one folder, as compose's
do: the aggregator then publishes each round's model once, not once per learner.

Usage: python benchmarks/large_model.py [--width 2048] [--depth 13] [--learners 2] [--shared-models]
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

from targets import emit  # noqa: E402 - benchmarks/, the script's own folder

from tests.e2e.cluster import cluster  # noqa: E402

MiB = 1024 * 1024


def rss_kib(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert match, field
    return int(match.group(1))


def bus_stats(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if '"bus_stats"' in line]


def write_spec(path: Path, name: str, hidden: list[int], clients: int) -> Path:
    path.write_text(json.dumps({
        "name": name,
        "seed": 0,
        "task": {"name": "digits", "options": {
            "model": {"name": "mlp", "hidden": hidden}, "partition": {"kind": "iid"}}},
        "clients": {"total": clients},
        "rounds": 1,
        "train": {"max_steps": 1, "lr": 0.01},
        "round_timeout_s": 1200,
    }))
    return path


def growth(idle_kib: int, peak_kib: int, model_bytes: int) -> float:
    return round((peak_kib - idle_kib) * 1024 / model_bytes, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=13)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--shared-models", action="store_true",
                        help="the learners share fetched models through one folder (FEDMQ_SHARED_MODELS_DIR)")
    args = parser.parse_args()
    width, depth = args.width, args.depth
    params = 64 * width + (depth - 1) * width**2 + width * 10 + width * depth + 10
    model_bytes = params * 4
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # The built-in digits Task with examples/plugins/big_mlp.py's model (an MLP of `depth`
        # hidden layers of `width`), after a warm-up job with a tiny one: the services' fixed
        # costs (the data stack's libraries, the digits data) are then in the warm idle RSS.
        warm_up = write_spec(root / "warm.yaml", "warm-up", [8], args.clients)
        spec = write_spec(root / "big.yaml", "big-model", [width] * depth, args.clients)
        shared = {"FEDMQ_SHARED_MODELS_DIR": str(root / "shared-models")} if args.shared_models else {}
        with cluster(root, learners=args.learners, FEDMQ_REQUEST_TIMEOUT_S="600", **shared) as c:
            c.wait_learners(args.learners)
            agg = c.procs["aggregator"].pid
            learners = [c.procs[f"learner-{i}"].pid for i in range(args.learners)]
            baseline = rss_kib(agg, "VmRSS")
            learner_baselines = [rss_kib(pid, "VmRSS") for pid in learners]
            warmed = c.fedmq("submit", str(warm_up), "--watch", timeout=600)
            warm = rss_kib(agg, "VmRSS")
            learner_warm = [rss_kib(pid, "VmRSS") for pid in learners]
            started = time.perf_counter()
            submitted = c.fedmq("submit", str(spec), "--watch", timeout=1800)
            wall = time.perf_counter() - started
            peak = rss_kib(agg, "VmHWM")
            learner_peaks = [rss_kib(pid, "VmHWM") for pid in learners]
            codes = c.stop_all()
            stats = {name: bus_stats(c.log(name)) for name in c.procs}
        submitted = submitted if warmed.returncode == 0 else warmed
        if submitted.returncode != 0:
            print(submitted.stderr[-3000:], file=sys.stderr)
            print(c.log("aggregator")[-3000:], file=sys.stderr)
            raise SystemExit("the round did not complete")
    frame = 4 * MiB
    largest = max(s["largest_frame_bytes"] for rows in stats.values() for s in rows)
    print(json.dumps({
        "model_mib": round(model_bytes / MiB, 1),
        "tensors": 2 * (args.depth + 1),
        "clients_in_round": args.clients,
        "learners": args.learners,
        "frame_limit_mib": frame / MiB,
        "largest_broker_message_mib": round(largest / MiB, 3),
        "every_message_within_frame": largest <= frame,
        "blobs_sent": {n: sum(s["blobs_sent"] for s in rows) for n, rows in stats.items()},
        "shared_models": args.shared_models,
        "aggregator_published_mib": round(sum(s["published_bytes"] for s in stats["aggregator"]) / MiB, 1),
        "aggregator_baseline_rss_mib": round(baseline / 1024, 1),
        "aggregator_warm_rss_mib": round(warm / 1024, 1),
        "aggregator_peak_rss_mib": round(peak / 1024, 1),
        "aggregator_growth_mib": round((peak - baseline) / 1024, 1),
        "aggregator_growth_vs_model": growth(baseline, peak, model_bytes),
        "aggregator_growth_over_warm_vs_model": growth(warm, peak, model_bytes),
        "learner_baseline_rss_mib": [round(b / 1024, 1) for b in learner_baselines],
        "learner_warm_rss_mib": [round(w / 1024, 1) for w in learner_warm],
        "learner_peak_rss_mib": [round(p / 1024, 1) for p in learner_peaks],
        "learner_growth_vs_model": [
            growth(idle, top, model_bytes) for idle, top in zip(learner_baselines, learner_peaks, strict=True)
        ],
        "learner_growth_over_warm_vs_model": [
            growth(idle, top, model_bytes) for idle, top in zip(learner_warm, learner_peaks, strict=True)
        ],
        "submit_to_done_s": round(wall, 1),
        "clean_exit": all(code == 0 for code in codes.values()),
    }, indent=2))
    # Two idle baselines, both reported: cold (torch loaded, no job yet) and warm (after a tiny
    # job of the same Task, which loads its data stack, ~95 MiB, whatever the model's size).
    model_mib = model_bytes / MiB
    for idle, name in ((baseline, "cold"), (warm, "warm")):
        emit(f"aggregator_peak_over_{name}", f"the aggregator's peak RSS over its {name} idle RSS, one round "
             f"of {args.clients} updates (FedAvg), against the model's size", figure=(peak - idle) / 1024,
             baseline=model_mib, unit="MiB", at_most=1.5)
    for idles, name in ((learner_baselines, "cold"), (learner_warm, "warm")):
        grown = max(top - idle for top, idle in zip(learner_peaks, idles, strict=True))
        emit(f"learner_peak_over_{name}", f"the most-grown learner's peak RSS over its {name} idle RSS, "
             "against the model's size", figure=grown / 1024, baseline=model_mib, unit="MiB", at_most=2.0)


if __name__ == "__main__":
    main()
