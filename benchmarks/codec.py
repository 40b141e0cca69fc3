"""Time encode_state and decode_state against a plain memory copy of the same bytes.

Run from the repo root: ``.venv/bin/python benchmarks/codec.py``. Prints one JSON
object. ``*_vs_memcpy`` is codec speed over memcpy speed, so 1.0 means as fast as
one copy. The baseline is ``bytes(memoryview(encoded))``: one copy of the bytes
decode reads into one fresh buffer the size encode writes, through the same
allocator, because both codec directions are one such copy plus framing.
``memcpy_prefaulted`` (a copy into an already-touched buffer) is for context only:
it skips the page faults that any fresh output, the codec's included, must take.
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

import msgpack  # noqa: E402
import torch  # noqa: E402

from fedmq.common.codec import decode_state, encode_state, state_digest  # noqa: E402


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


def main() -> None:
    """Build the state, time the three copies and print the JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="total state size in MiB")
    parser.add_argument("--tensors", type=int, default=8, help="number of equal float32 tensors")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; the best is kept")
    args = parser.parse_args()

    tensor_bytes = args.mib * 1024**2 // args.tensors
    generator = torch.Generator().manual_seed(0)
    state = {
        f"layer{i}.weight": torch.randn(tensor_bytes // 4, generator=generator) for i in range(args.tensors)
    }
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    encoded = encode_state(state)
    digest_matches = state_digest(decode_state(encoded)) == state_digest(state)

    target = bytearray(len(encoded))

    def copy_into_target() -> None:
        memoryview(target)[:] = memoryview(encoded)

    timings = {
        "memcpy": best_seconds(lambda: bytes(memoryview(encoded)), args.repeats),
        "memcpy_prefaulted": best_seconds(copy_into_target, args.repeats),
        "encode": best_seconds(lambda: encode_state(state), args.repeats),
        "decode": best_seconds(lambda: decode_state(encoded), args.repeats),
    }
    report: dict[str, Any] = {
        "tensors": args.tensors,
        "tensor_bytes": tensor_bytes,
        "state_bytes": state_bytes,
        "encoded_bytes": len(encoded),
        "repeats": args.repeats,
        "baseline": "bytes(memoryview(encoded))",
    }
    for name, seconds in timings.items():
        report[f"{name}_s"] = round(seconds, 6)
        report[f"{name}_gb_per_s"] = round(state_bytes / seconds / 1e9, 3)
    report["encode_vs_memcpy"] = round(timings["memcpy"] / timings["encode"], 3)
    report["decode_vs_memcpy"] = round(timings["memcpy"] / timings["decode"], 3)
    report["digest_matches"] = digest_matches
    report["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
