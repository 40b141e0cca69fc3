"""What one job may take of the aggregator: its model's size, its disk, and the checkpoints it keeps.

    JobCreate ─▶ model built ─▶ bytes ≤ FEDMQ_MAX_MODEL_BYTES, else the job fails
    before an update is stored, and before a round closes (its checkpoint) ─▶
        the job's folder + what comes ≤ FEDMQ_JOB_DISK_BYTES, else the job fails
    after a round commits ─▶ checkpoints of rounds older than the last FEDMQ_KEEP_CHECKPOINTS
        are deleted, except those the scheduler asks to keep (the best round's)

A job past a limit fails at once with OverLimit's message (naming the setting); nothing more is
written for it. The disk in use is measured by walking the job's folder, then counted up as
updates and checkpoints come. The count is not exact (deletions are not counted down; a strategy's
state, per-client state and the final model are not counted up), so the folder is walked again
before any refusal, every 16 rounds, and every round for a job that keeps per-client state (a walk
every round cost 6 ms of a 50 ms round).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from fedmq.common.errors import FedmqError


class OverLimit(FedmqError):
    """A job past one of its deployment's limits; `limit` is its JOB_LIMITS label."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


def model_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def check_model(weights: Mapping[str, torch.Tensor], max_bytes: int) -> None:
    size = model_bytes(weights)
    if size > max_bytes:
        raise OverLimit("model_bytes", f"the job's model has {size} bytes of tensors, more than this "
                        f"deployment allows ({max_bytes}, FEDMQ_MAX_MODEL_BYTES)")


def folder_bytes(root: Path) -> int:
    """Bytes of every file under `root` (0 if it does not exist); no recursion, links not followed."""
    total, pending = 0, [root]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                pending.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


# The job's own small files (its open and closed rounds, its rounds' list) are rewritten, not
# counted as they grow: a quota keeps this much room for them between measures of the folder.
BOOKKEEPING_BYTES = 4096


class DiskQuota:
    """One job's disk in use against its quota: measured once, counted up as files come."""

    def __init__(self, root: Path, quota: int) -> None:
        self.root, self.quota = root, quota
        self._used: int | None = None

    @property
    def used(self) -> int:
        if self._used is None:
            self._used = folder_bytes(self.root)
        return self._used

    def need(self, size: int, what: str) -> None:
        """Raise OverLimit unless `size` more bytes fit, with room for the job's small files that grow
        uncounted between measures (BOOKKEEPING_BYTES); then count them as used."""
        if self.used + size + BOOKKEEPING_BYTES > self.quota:
            self.measure()  # the count may hold files deleted since: look before refusing
        if self.used + size + BOOKKEEPING_BYTES > self.quota:
            raise OverLimit("disk_quota", f"{what} ({size} bytes) would take the job's aggregator state to "
                            f"{self.used + size} bytes, over its quota ({self.quota}, FEDMQ_JOB_DISK_BYTES)")
        self._used = self.used + size

    def measure(self) -> None:
        """Forget the count: the next check walks the folder again (after files were deleted)."""
        self._used = None


def retained(rounds: Mapping[int, str], last: int, keep_rounds: int, keep: Iterable[str]) -> set[str]:
    """The checkpoint digests to keep: rounds after `last - keep_rounds`, and `keep`. 0 keeps all."""
    if keep_rounds == 0:
        return set(rounds.values()) | set(keep)
    return {d for r, d in rounds.items() if r > last - keep_rounds} | set(keep)
