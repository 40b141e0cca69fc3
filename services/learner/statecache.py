"""Client state kept where it was made: a learner's own copy of each client's state, by version.

    Work.train ──▶ the cache holds the client with the task's state_tag ──▶ hit: that state, no
                   ClientStateGet to the aggregator
               └─▶ else ──▶ miss: fetched from the aggregator's durable copy, as before
    after training ──▶ put(job, client, tag, state): the state the update carries, under the
                       update's random ClientUpdate.state_tag

The aggregator keeps the durable copy of every client's state (what its updates carried, for the
rounds whose close folded them); this cache is a copy of that copy, trusted only for the version
the scheduler names: the tag of the update whose fold last took the client in
(`TrainTask.state_tag`). A client trained again (a nudge's duplicate, a stale task, a restarted
learner) gets a new tag, so only the training the aggregator folded can match. Anything else is
fetched. So a hit gives the same bits as a fetch, and losing the cache (a SIGKILL, an eviction)
costs a fetch, never a result.

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

from fedmq.common.codec.compress import encoded_nbytes
from fedmq.common.codec.state import decode_state, encode_state
from fedmq.common.codec.updates import RESERVED
from fedmq.common.task.sealing import StateSealer
from fedmq.common.task.state import STATE

log = structlog.get_logger("fedmq.learner")

Key = tuple[str, int]  # (job id, client)


TAG = "fedmq.cache.tag"  # a spilled file's own tag, sealed with its state where the learner seals


@dataclass
class _Kept:
    tag: str
    state: dict[str, torch.Tensor] | None  # None: spilled to its file
    size: int


class StateCache:
    """Clients' state by (job, client), tagged with the training that made it, bounded in memory
    and on disk."""

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
        for stale in self.folder.iterdir() if self.folder.is_dir() else []:
            if stale.is_file():
                stale.unlink(missing_ok=True)

    def put(self, job_id: str, client: int, tag: str, state: Mapping[str, torch.Tensor]) -> None:
        """The state `client` made in the training tagged `tag`: of its update's extras and state (in
        the clear), fedmq's entries are kept. A spill that fails (a full disk) drops what it could
        not write: fetched later."""
        kept = {k: v for k, v in state.items() if k.startswith(RESERVED)}
        size = encoded_nbytes(kept)
        with self._lock:
            self._drop((job_id, client))
            if not tag:
                return
            if size > self.memory_bytes and size > self.disk_bytes:
                self._on_event("too_large")
                return
            self._kept[(job_id, client)] = _Kept(tag, kept, size)
            self._in_memory += size
            self._fit()

    def get(self, job_id: str, client: int, tag: str) -> dict[str, torch.Tensor] | None:
        """The client's state of the training tagged `tag`, or None (not here, or another one)."""
        with self._lock:
            kept = self._kept.get((job_id, client))
            if not tag or kept is None or kept.tag != tag:
                return None
            self._kept.move_to_end((job_id, client))
            if kept.state is not None:  # copies: training may change its state in place, and fail
                self._on_event("hit")
                return {k: v.clone() for k, v in kept.state.items()}
            try:
                state = self._read(job_id, client, tag)
            except Exception as exc:  # unreadable or tampered with: the durable copy is fetched instead
                log.warning("state_cache_unreadable", client=client, error=repr(exc)[:300])
                self._drop((job_id, client))
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
            written = False
            if kept.size <= self.disk_bytes:
                try:
                    self._write(key, kept)
                    written = True
                except Exception as exc:  # a full disk, a seal that failed: dropped, fetched later
                    log.warning("state_cache_unwritable", error=repr(exc)[:300])
            self._in_memory -= kept.size
            kept.state = None
            if written:
                self._on_disk += kept.size
                self._on_event("spilled")
            else:
                del self._kept[key]
                self._on_event("evicted")
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

    def _write(self, key: Key, kept: _Kept) -> None:
        """The state to its file, with its tag (inside the seal where the learner seals: an older
        file of the same client put in its place does not open as this one)."""
        job_id, client = key
        assert kept.state is not None
        tag = torch.frombuffer(bytearray(kept.tag.encode()), dtype=torch.uint8)
        state = {**kept.state, TAG: tag}
        if self.sealer is not None:
            task_state = {k: v for k, v in state.items() if k.startswith(STATE) or k == TAG}
            others = {k: v for k, v in state.items() if k not in task_state}
            state = others | self.sealer.seal(task_state, job_id, client)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(job_id, client)
        partial = path.with_suffix(".partial")
        partial.write_bytes(encode_state(state))
        os.replace(partial, path)

    def _read(self, job_id: str, client: int, tag: str) -> dict[str, torch.Tensor]:
        state = decode_state(self._path(job_id, client).read_bytes())
        if self.sealer is not None:
            state = self.sealer.open(state, job_id, client)
        found = state.pop(TAG, None)
        if found is None or bytes(found.numpy().tobytes()) != tag.encode():
            raise ValueError(f"client {client}'s spilled state is of another training")
        return {k: v.clone() for k, v in state.items()}
