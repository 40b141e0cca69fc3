"""A process that holds a large model gives the memory of the large buffers it frees back at once.

glibc's malloc raises its mmap threshold to the size of each large block freed (up to 32 MiB on
64 bits), so once a large model's first tensors are freed the next ones come from the heap, whose
freed pages the process keeps. `large_buffers_unmapped` fixes the threshold at MMAP_THRESHOLD,
from the first model of LARGE_MODEL_BYTES or more on: a learner (a model kept in a file) and the
aggregator (a job's model). Measured with benchmarks/large_model.py, a 202 MB model: a learner's
peak +2.8-3.0x the model over its warm idle before, +2.2x after; the aggregator's +1.31-1.50x
before, +1.25x after. Not in every process: with small
models each step's buffers of a MiB or more would map fresh pages (a small CNN's CPU step took
71-73 ms against 40-44 ms); a 50 M-parameter MLP's step took the same within 2 %.
"""

from __future__ import annotations

import ctypes
import ctypes.util

LARGE_MODEL_BYTES = 64 * 1024 * 1024  # a model this large or larger fixes the threshold
MMAP_THRESHOLD = 1024 * 1024  # then buffers this large or larger each get a mapping of their own
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_fixed = False


def large_buffers_unmapped() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD, once; nothing without glibc."""
    global _fixed
    if _fixed:
        return
    _fixed = True
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return  # musl, macOS: another allocator
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
