"""The learner registry: who is alive, where, on what device, and their DDP ranks (seed 003).

    heartbeat ──▶ alive ──(silent > dead_after_intervals × interval_s, at sweep)──▶ dead
                    ▲                                                                │
                    └──────────────────────(a later heartbeat)───────────────────────┘

Liveness uses the receiver's clock (`now`, a monotonic reading the caller passes in), never
the sender's `sent_at`. Ranks are recomputed from the alive set whenever it is read, so a
learner that dies or leaves closes its gap the same way on every call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedmq.common.errors import ConfigError
from fedmq.common.messages import Heartbeat

DEFAULT_INTERVAL_S = 5.0  # used when a heartbeat announces a non-positive or non-finite interval
AGE_DIGITS = 1


@dataclass(frozen=True)
class Ranks:
    rank: int
    local_rank: int
    node_rank: int
    world_size: int


@dataclass(frozen=True)
class LearnerInfo:
    """One row of `fedmq learners`; ranks are None for a dead learner."""

    learner: str
    node: str
    replica: int
    device: str
    busy: bool
    pid: int
    last_seen: float  # receiver's monotonic clock when last heard
    alive: bool
    rank: int | None
    local_rank: int | None
    node_rank: int | None
    world_size: int
    sites: tuple[str, ...] = ()
    group: str = ""  # the DDP group it runs a rank of (job/attempt)

    def as_dict(self, now: float) -> dict[str, Any]:
        """JSON-friendly row: every field but the process-local `last_seen`, plus `age_s`."""
        row: dict[str, Any] = {
            "learner": self.learner,
            "node": self.node,
            "replica": self.replica,
            "device": self.device,
            "busy": self.busy,
            "pid": self.pid,
            "alive": self.alive,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node_rank": self.node_rank,
            "world_size": self.world_size,
            "sites": list(self.sites),
            "group": self.group,
            "age_s": round(max(0.0, now - self.last_seen), AGE_DIGITS),
        }
        return row


def _member_key(member: tuple[str, str, int]) -> tuple[int, str]:
    learner, _node, replica = member
    return replica, learner


def assign_ranks(members: list[tuple[str, str, int]], master_node: str = "") -> dict[str, Ranks]:
    """Ranks for (learner, node, replica) members by the rules of seed 003.

    Nodes: the master node first (``master_node`` if any member is on it, else the first node
    by name), then the others sorted by name. Within a node: workers by numeric replica id,
    ties by learner name. ``rank`` is the position in that order, ``local_rank`` counts from
    0 on each node, ``node_rank`` is the node's position, ``world_size`` is len(members).
    """
    names = [learner for learner, _, _ in members]
    if len(set(names)) != len(names):
        raise ValueError("learner names must be unique")
    by_node: dict[str, list[tuple[str, str, int]]] = {}
    for member in members:
        by_node.setdefault(member[1], []).append(member)
    nodes = sorted(by_node)
    if master_node in by_node:
        nodes.remove(master_node)
        nodes.insert(0, master_node)

    ranks: dict[str, Ranks] = {}
    world_size = len(members)
    rank = 0
    for node_rank, node in enumerate(nodes):
        for local_rank, (learner, _, _) in enumerate(sorted(by_node[node], key=_member_key)):
            ranks[learner] = Ranks(rank, local_rank, node_rank, world_size)
            rank += 1
    return ranks


def ddp_env(ranks: Ranks, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment a learner exports for torch.distributed's env:// init."""
    if not master_addr:
        raise ConfigError("master_addr must name the master node")
    if not 0 < master_port < 65536:
        raise ConfigError(f"master_port must be in 1..65535, got {master_port}")
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(ranks.world_size),
        "RANK": str(ranks.rank),
        "LOCAL_RANK": str(ranks.local_rank),
        "NODE_RANK": str(ranks.node_rank),
    }


@dataclass
class _Entry:
    hb: Heartbeat
    last_seen: float
    alive: bool = True

    @property
    def member(self) -> tuple[str, str, int]:
        return self.hb.learner, self.hb.node, self.hb.replica

    def deadline(self, dead_after_intervals: float) -> float:
        interval = self.hb.interval_s
        if not (math.isfinite(interval) and interval > 0):
            interval = DEFAULT_INTERVAL_S
        return self.last_seen + dead_after_intervals * interval


class Registry:
    """Learners known from their heartbeats; pure and clock-injected (pass `now` in)."""

    def __init__(self, master_node: str = "", dead_after_intervals: float = 3.0) -> None:
        if not (math.isfinite(dead_after_intervals) and dead_after_intervals > 0):
            raise ConfigError(f"dead_after_intervals must be a positive number, got {dead_after_intervals}")
        self.master_node = master_node
        self.dead_after_intervals = dead_after_intervals
        self._entries: dict[str, _Entry] = {}

    def heartbeat(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when membership changed (new, revived, or moved node/replica)."""
        entry = self._entries.get(hb.learner)
        if entry is None:
            self._entries[hb.learner] = _Entry(hb, now)
            return True
        changed = not entry.alive or (entry.hb.node, entry.hb.replica) != (hb.node, hb.replica)
        entry.hb = hb
        entry.last_seen = max(entry.last_seen, now)  # a late delivery never moves the clock back
        entry.alive = True
        return changed

    def sweep(self, now: float) -> list[str]:
        """Mark learners silent past their deadline as dead; the names that just died, sorted."""
        died = []
        for name, entry in self._entries.items():
            if entry.alive and now > entry.deadline(self.dead_after_intervals):
                entry.alive = False
                died.append(name)
        return sorted(died)

    def forget(self, learner: str) -> None:
        """Drop a learner that shut down cleanly; unknown names are ignored."""
        self._entries.pop(learner, None)

    def alive(self) -> list[LearnerInfo]:
        """The alive learners as of the last sweep, ordered by rank."""
        return [info for info in self._rows(lambda entry: entry.alive) if info.alive]

    def snapshot(self, now: float) -> list[LearnerInfo]:
        """Every known learner, alive first by rank, then the dead by node, replica and name.

        Read-only: a learner already past its deadline at `now` shows as dead (and out of the
        ranks) even before `sweep` records it, so the table never shows a stale learner alive.
        """
        limit = self.dead_after_intervals
        return self._rows(lambda entry: entry.alive and now <= entry.deadline(limit))

    def is_free(self, learner: str) -> bool:
        """Whether `learner` was alive at the last sweep and runs no DDP rank (it takes tasks)."""
        entry = self._entries.get(learner)
        return entry is not None and entry.alive and not entry.hb.group

    def serving(self, site: str | None) -> int:
        """How many alive learners take tasks from `site`'s queue (None: the shared queue, which
        learners hosting no site take from), DDP ranks left out (as of the last sweep)."""
        return sum(entry.alive and not entry.hb.group
                   and (site in entry.hb.sites if site is not None else not entry.hb.sites)
                   for entry in self._entries.values())

    def hosted_sites(self) -> set[str]:
        """The sites some alive learner hosts (as of the last sweep)."""
        return {site for entry in self._entries.values() if entry.alive for site in entry.hb.sites}

    @property
    def alive_count(self) -> int:
        return sum(entry.alive for entry in self._entries.values())

    @property
    def busy_count(self) -> int:
        return sum(entry.alive and entry.hb.busy for entry in self._entries.values())

    def _rows(self, is_alive: Callable[[_Entry], bool]) -> list[LearnerInfo]:
        entries = list(self._entries.values())
        living = [entry for entry in entries if is_alive(entry)]
        ranks = assign_ranks([entry.member for entry in living], self.master_node)
        dead = sorted(
            (entry for entry in entries if not is_alive(entry)),
            key=lambda entry: (entry.hb.node, entry.hb.replica, entry.hb.learner),
        )
        living.sort(key=lambda entry: ranks[entry.hb.learner].rank)
        rows = [_info(entry, ranks.get(entry.hb.learner), len(living)) for entry in living]
        rows += [_info(entry, None, len(living)) for entry in dead]
        return rows


def _info(entry: _Entry, ranks: Ranks | None, world_size: int) -> LearnerInfo:
    hb = entry.hb
    return LearnerInfo(
        learner=hb.learner,
        node=hb.node,
        replica=hb.replica,
        device=hb.device,
        busy=hb.busy,
        pid=hb.pid,
        last_seen=entry.last_seen,
        alive=ranks is not None,
        rank=None if ranks is None else ranks.rank,
        local_rank=None if ranks is None else ranks.local_rank,
        node_rank=None if ranks is None else ranks.node_rank,
        world_size=world_size,
        sites=tuple(hb.sites),
        group=hb.group,
    )
