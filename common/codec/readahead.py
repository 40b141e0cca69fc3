"""Reading one tensor of many stored updates in turn, the next ones read on other threads meanwhile.

    read_column(files, "w") ─▶ files[0]["w"], files[1]["w"], ...   in order
                               READ_AHEAD of them being read ahead (at most READ_AHEAD_HELD bytes)

A fold over stored updates (the aggregator's kernels.WeightedMean) spends most of its time copying
tensors out of the page cache: reading the next while one is folded hides it. Small tensors are
read one after another (a thread costs more). TensorFile.read_column is this function: the kernel
asks its inputs how a column of them is read, and never opens a file itself.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from fedmq.common.codec.files import TensorFile

READ_AHEAD = 2  # results' tensors read from their files while one is folded (each one tensor more)
READ_AHEAD_BYTES = 1024 * 1024  # smaller tensors are read one after another: a thread costs more
READ_AHEAD_HELD = 64 * 1024 * 1024  # at most this much read ahead: a 1 GB embedding is read alone


def read_column(files: Sequence[TensorFile], name: str) -> Generator[torch.Tensor]:
    """files[i][name] for each file in order: a large tensor read ahead on other threads, a small
    one (or a single file's) read here. A read that fails raises in order."""
    if len(files) > 1:
        dtype, shape = files[0].meta(name)
        size = math.prod(shape) * dtype.itemsize
        ahead = min(READ_AHEAD, READ_AHEAD_HELD // max(size, 1))
        if size >= READ_AHEAD_BYTES and ahead > 0:
            return _read_ahead(files, name, ahead)
    return (file[name] for file in files)


def _read_ahead(files: Sequence[TensorFile], name: str, ahead: int) -> Generator[torch.Tensor]:
    """files[i][name] for each i in order, `ahead` of them being read on other threads meanwhile.
    A read that fails raises here, in order; the reads not yet begun are dropped."""
    pool, waiting = _readers(), deque[Future["torch.Tensor"]]()
    try:
        for file in files:
            waiting.append(pool.submit(file.__getitem__, name))
            if len(waiting) > ahead:
                yield waiting.popleft().result()  # no reference kept here once folded
        while waiting:
            yield waiting.popleft().result()
    finally:
        for future in waiting:
            future.cancel()


@functools.cache
def _readers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(READ_AHEAD + 1, thread_name_prefix="fold-read")
