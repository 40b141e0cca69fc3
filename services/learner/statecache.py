"""Client state kept where it was made: a learner's own copy of each client's state, by version.

    Work.train ──▶ task.state_holder is this learner and the cache holds the client at
                   task.state_from ──▶ hit: the state, no ClientStateGet to the aggregator
               └─▶ else ──▶ miss: fetched from the aggregator's durable copy, as before
    after training ──▶ put(job, client, round, state): the state the update carries

The aggregator keeps the durable copy of every client's state (what its updates carried, for the
rounds whose close folded them); this cache is a copy of that copy, trusted only for the version
the scheduler names: the round whose close last folded the client, and the learner whose update it
folded (`TrainTask.state_from`, `state_holder`). Any other version, or a client another learner
trained, is fetched. So a hit gives the same bits as a fetch, and losing the cache (a SIGKILL, an
eviction) costs a fetch, never a result.

Memory holds up to FEDMQ_STATE_CACHE_BYTES; the least recently used spill to files under the
learner's state directory, up to FEDMQ_STATE_CACHE_DISK_BYTES, then go. Spilled state is encoded
with the wire codec (no pickle) and sealed with FEDMQ_STATE_KEY where the learner has one, as it
would travel.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from fedmq.common.codec.state import decode_state, encode_state
from fedmq.common.codec.updates import RESERVED
from fedmq.common.task.sealing import StateSealer
from fedmq.common.task.state import STATE

log = structlog.get_logger("fedmq.learner")

Key = tuple[str, int]  # (job id, client)


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class _Kept:
    round: int
    state: dict[str, torch.Tensor] | None  # None: spilled to its file
    size: int


class StateCache:
    """Clients' state by (job, client), the round it was made in, bounded in memory and on disk."""

    def __init__(
        self, folder: Path, memory_bytes: int, disk_bytes: int, sealer: StateSealer | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.folder = folder
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes
        self.sealer = sealer
        self._on_event = on_event or (lambda _: None)
        self._kept: OrderedDict[Key, _Kept] = OrderedDict()  # least recently used first
        self._in_memory = 0
        self._on_disk = 0
        self._lock = threading.Lock()  # the training thread puts and gets; `close` may come from another
        # Files an earlier process spilled: versions nobody can vouch for now (fetched instead).
        for stale in self.folder.glob("*.state*") if self.folder.is_dir() else []:
            stale.unlink(missing_ok=True)

    def put(self, job_id: str, client: int, server_round: int, state: Mapping[str, torch.Tensor]) -> None:
        """The state `client` made training `server_round` (its update's fedmq entries, in the clear)."""
        kept = {k: v for k, v in state.items() if k.startswith(RESERVED)}
        size = state_bytes(kept)
        with self._lock:
            self._drop((job_id, client))
            if size > self.memory_bytes and size > self.disk_bytes:
                self._on_event("too_large")
                return
            self._kept[(job_id, client)] = _Kept(server_round, kept, size)
            self._in_memory += size
            self._fit()

    def get(self, job_id: str, client: int, server_round: int) -> dict[str, torch.Tensor] | None:
        """The client's state made in `server_round`, or None (not here, or another version)."""
        with self._lock:
            kept = self._kept.get((job_id, client))
            if kept is None or kept.round != server_round:
                self._on_event("miss")
                return None
            self._kept.move_to_end((job_id, client))
            if kept.state is not None:  # copies: training may change its state in place, and fail
                self._on_event("hit")
                return {k: v.clone() for k, v in kept.state.items()}
            try:
                state = self._read(job_id, client)
            except Exception as exc:  # unreadable or tampered with: the durable copy is fetched instead
                log.warning("state_cache_unreadable", client=client, error=repr(exc)[:300])
                self._drop((job_id, client))
                self._on_event("miss")
                return None
            self._on_event("hit")
            return state

    def close(self) -> None:
        """Forget everything, spilled files too."""
        with self._lock:
            for key in list(self._kept):
                self._drop(key)

    @property
    def memory_used(self) -> int:
        return self._in_memory

    @property
    def disk_used(self) -> int:
        return self._on_disk

    def __len__(self) -> int:
        return len(self._kept)

    def _fit(self) -> None:
        """Spill the least recently used until memory fits; then drop them until the disk does."""
        for key, kept in list(self._kept.items()):
            if self._in_memory <= self.memory_bytes:
                break
            if kept.state is None:
                continue
            if kept.size <= self.disk_bytes:
                self._write(key, kept.state)
                self._on_disk += kept.size
            else:
                del self._kept[key]
            self._in_memory -= kept.size
            kept.state = None
            self._on_event("spilled")
        for key, kept in list(self._kept.items()):
            if self._on_disk <= self.disk_bytes:
                break
            if kept.state is None:
                self._drop(key)
                self._on_event("evicted")

    def _drop(self, key: Key) -> None:
        kept = self._kept.pop(key, None)
        if kept is None:
            return
        if kept.state is not None:
            self._in_memory -= kept.size
        else:
            self._on_disk -= kept.size
            self._path(*key).unlink(missing_ok=True)

    def _path(self, job_id: str, client: int) -> Path:
        name = hashlib.sha256(job_id.encode()).hexdigest()[:24]
        return self.folder / f"{name}-{client}.state"

    def _write(self, key: Key, state: dict[str, torch.Tensor]) -> None:
        job_id, client = key
        if self.sealer is not None:
            task_state = {k: v for k, v in state.items() if k.startswith(STATE)}
            others = {k: v for k, v in state.items() if not k.startswith(STATE)}
            state = others | (self.sealer.seal(task_state, job_id, client) if task_state else {})
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(job_id, client)
        partial = path.with_suffix(".partial")
        partial.write_bytes(encode_state(state))
        os.replace(partial, path)

    def _read(self, job_id: str, client: int) -> dict[str, torch.Tensor]:
        state = decode_state(self._path(job_id, client).read_bytes())
        if self.sealer is not None:
            state = self.sealer.open(state, job_id, client)
        return {k: v.clone() for k, v in state.items()}
