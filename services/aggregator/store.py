"""The aggregator's disk: global checkpoints by content hash, and each round's accepted updates.

    <state>/aggregator/<job>/
        spec.json                      the job spec as the scheduler sent it
        rounds.json                    round → checkpoint key
        open.json, closed.json         the open round's clients; the last RoundClosed sent
        checkpoints/<key>.safetensors  key = <weights digest>-<state digest>: the global weights
                                       and the strategy's state (older jobs: <weights digest>)
        updates/r<round>/c<client>.msg raw ClientUpdate bodies, until the round closes (staged as
                                       .c<client>.msg.<pid>.tmp until their group commit)
        updates/r<round>/g<seq>.msg    raw GroupUpdate bodies: a fused group's updates (grouped.py)
        clients/c<client>/r<round>.safetensors   the strategy's per-client state (common/strategy/clients)
        residuals/c<client>/r<round>.safetensors topk's per-client residual as it travelled, the same way
        early/r<round>/c<client>.msg   updates that came before their round's RoundOpen
    <state>/aggregator/.trash/         a closed round's updates, old checkpoints: being deleted

An accepted update is written before it is acknowledged, so the round's
results survive a restart, and a client's file exists at most once: that is
what makes a redelivered update change nothing. At close the updates are read
back one at a time in client order (bounded memory, order-independent result).

This module is the layout only; every write goes through common/statefiles (whole
or not at all, fsynced, a failure raised as StateUnwritable). What the files mean
to a round is the business of the modules that read them.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedmq.common import codec, statefiles
from fedmq.common.checkpoint import load_state, save_state
from fedmq.common.errors import StateUnwritable
from fedmq.services.aggregator.grouped import GROUP_PREFIX, GroupFile, GroupRow, group_files

TRASH = ".trash"  # beside the jobs' folders: emptied when the aggregator starts
DIGEST = re.compile(r"[0-9a-f]{64}")  # codec.state_digest's form: what a learner may ask for


def weights_digest(key: str) -> str:
    """The global weights' digest in a checkpoint key (an older job's key is that digest alone)."""
    return key.partition("-")[0]


class JobStore:
    """Everything the aggregator keeps for one job."""

    def __init__(self, root: Path, job_id: str, sync: bool = True) -> None:
        """`sync`: fsync every write (FEDMQ_FSYNC; statefiles)."""
        self.root = root / job_id
        self.trash = root / TRASH  # what is deleted on a background thread (statefiles.discard)
        self.job_id = job_id
        self.sync = sync
        self._rounds: dict[int, str] | None = None  # rounds.json, as this store last read or wrote it
        self._groups: dict[int, dict[int, tuple[GroupFile, int]]] = {}  # round -> grouped updates' index
        self._group_seq: dict[int, int] = {}  # round -> its last group file's number
        self._staged: dict[tuple[int, int], Path] = {}  # (round, client) -> its staged temporary file
        # Groups staged: (round, temporary file, final path, members, the members it stores).
        self._staged_groups: list[tuple[int, Path, Path, list[int], list[int]]] = []

    # -- spec and round index -------------------------------------------------

    def save_spec(self, spec_json: str) -> None:
        statefiles.atomic_write(self.root / "spec.json", spec_json.encode(), self.sync)

    def rounds(self) -> dict[int, str]:
        """round -> checkpoint key of every committed round (read once, then kept as committed)."""
        if self._rounds is None:
            path = self.root / "rounds.json"
            stored = json.loads(path.read_text()) if path.exists() else {}
            self._rounds = {int(k): v for k, v in stored.items()}
        return dict(self._rounds)

    def load_spec(self) -> str | None:
        path = self.root / "spec.json"
        return path.read_text() if path.exists() else None

    def save_json(self, name: str, value: dict[str, Any]) -> None:
        """Small records that let a restarted aggregator pick up: the open round, the last close."""
        statefiles.atomic_write(self.root / f"{name}.json", json.dumps(value).encode(), self.sync)

    def load_json(self, name: str) -> dict[str, Any] | None:
        path = self.root / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    # -- checkpoints ----------------------------------------------------------

    def write_checkpoint(
        self, server_round: int, state: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor]
    ) -> str:
        """Store global weights and strategy state under a key of both; not yet the job's round.

        The key holds the state's digest too: a strategy whose weights stay the same while its
        state moves on must not overwrite an earlier round's checkpoint with a later state.
        """
        key = f"{codec.state_digest(state)}-{codec.state_digest(extra)}"
        tensors = {f"w.{k}": v for k, v in state.items()} | {f"s.{k}": v for k, v in extra.items()}
        save_state(self.checkpoint_path(key), tensors, {"round": str(server_round)}, self.sync)
        return key

    def commit_round(self, server_round: int, key: str) -> None:
        """Make checkpoint `key` the round's: the point from which a restart resumes."""
        rounds = self.rounds() | {server_round: key}
        body = json.dumps(rounds, sort_keys=True).encode()
        statefiles.atomic_write(self.root / "rounds.json", body, self.sync)
        self._rounds = rounds

    def load_checkpoint(self, key: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(weights, strategy state) of the checkpoint `key` (a rounds.json value)."""
        tensors, _ = load_state(self.checkpoint_path(key))
        weights = {k[2:]: v for k, v in tensors.items() if k.startswith("w.")}
        extra = {k[2:]: v for k, v in tensors.items() if k.startswith("s.")}
        return weights, extra

    def checkpoint_path(self, key: str) -> Path:
        return self.root / "checkpoints" / f"{key}.safetensors"

    def find_weights(self, digest: str) -> Path | None:
        """A checkpoint holding the global weights with `digest` (any state beside them), or None."""
        if not DIGEST.fullmatch(digest):
            return None
        folder = self.root / "checkpoints"
        found = sorted(folder.glob(f"{digest}-*.safetensors")) + [folder / f"{digest}.safetensors"]
        return next((path for path in found if path.is_file()), None)

    def load_weights(self, digest: str) -> dict[str, torch.Tensor]:
        """The global weights with `digest`; KeyError if no checkpoint holds them."""
        path = self.find_weights(digest)
        if path is None:
            raise KeyError(f"no checkpoint holds the weights {digest[:12]}")
        return self.load_checkpoint(path.stem)[0]

    def prune_checkpoints(self, keep: set[str]) -> list[str]:
        """Delete every checkpoint not named in `keep`, by its key (a rounds.json value) or by the digest
        of the weights it holds (a model_digest, as the scheduler names the best); the keys deleted."""
        gone = sorted(
            p.stem for p in (self.root / "checkpoints").glob("*.safetensors")
            if p.stem not in keep and p.stem.partition("-")[0] not in keep
        )
        for digest in gone:
            statefiles.discard(self.checkpoint_path(digest), self.trash)
        return gone

    # -- updates --------------------------------------------------------------

    def _updates(self, server_round: int) -> Path:
        return self.root / "updates" / f"r{server_round}"

    def _update_path(self, server_round: int, client: int) -> Path:
        return self._updates(server_round) / f"c{client}.msg"

    def has_update(self, server_round: int, client: int) -> bool:
        """Stored, or staged to be (a redelivery meanwhile is a duplicate)."""
        return ((server_round, client) in self._staged or client in self._grouped(server_round)
                or any(r == server_round and client in new for r, _, _, _, new in self._staged_groups)
                or self._update_path(server_round, client).exists())

    def put_update(self, server_round: int, client: int, body: bytes | Path) -> None:
        """Keep an update's body (moving it if it is a file); once it exists it is stored."""
        _put(self._update_path(server_round, client), body, self.sync)  # a spool file was fsynced on receipt

    def stage_update(self, server_round: int, client: int, body: bytes) -> None:
        """Write an update's body without storing it yet: `commit_staged` stores every staged one
        at once (the aggregator's group commit). Until then it is neither read nor listed."""
        path = self._update_path(server_round, client)
        self._staged[(server_round, client)] = statefiles.stage(path, body)

    def stage_group(self, server_round: int, body: bytes, members: list[int]) -> list[int]:
        """As put_group, written without storing it yet: `commit_staged` stores it with the staged
        updates. Returns the members it will store; nothing is written when there are none."""
        new, path = self._new_group(server_round, members)
        if new:
            self._staged_groups.append((server_round, statefiles.stage(path, body), path, members, new))
        return new

    def _new_group(self, server_round: int, members: list[int]) -> tuple[list[int], Path]:
        """A group's members not stored before (nor staged), and the path of the round's next group
        file (its number taken when there are any)."""
        self._grouped(server_round)  # after a restart: the round's last group file's number
        new = [c for c in members if not self.has_update(server_round, c)]
        seq = self._group_seq.get(server_round, 0) + 1
        if new:
            self._group_seq[server_round] = seq
        return new, self._updates(server_round) / f"{GROUP_PREFIX}{seq}.msg"

    def commit_staged(self) -> None:
        """Store the staged updates and groups (fsynced, renamed into place, each folder fsynced
        once). A failure raises StateUnwritable with none staged any more: those not stored are
        deleted."""
        staged, self._staged = self._staged, {}
        groups, self._staged_groups = self._staged_groups, []
        pairs = [(tmp, self._update_path(r, c)) for (r, c), tmp in staged.items()]
        pairs += [(tmp, path) for _, tmp, path, _, _ in groups]
        try:
            statefiles.commit(pairs, self.sync)
        except StateUnwritable:
            for tmp, _ in pairs:
                tmp.unlink(missing_ok=True)
            for server_round, *_ in groups:  # a group renamed before the failure: read from the folder
                self._groups.pop(server_round, None)
            raise
        for server_round, _, path, members, new in groups:
            self._index_group(server_round, path, members, new)

    def put_group(self, server_round: int, body: bytes | Path, members: list[int]) -> list[int]:
        """Keep a GroupUpdate's body once (grouped.py); the members not stored before become stored.
        Returns those members; nothing is written when there are none."""
        new, path = self._new_group(server_round, members)
        if new:
            _put(path, body, self.sync)
            self._index_group(server_round, path, members, new)
        return new

    def _index_group(self, server_round: int, path: Path, members: list[int], new: list[int]) -> None:
        """A stored group's `new` members read from it from now on."""
        index = self._grouped(server_round)
        group, adopting = GroupFile(path), set(new)
        for row, client in enumerate(members):
            if client in adopting:
                index[client] = (group, row)
                group.adopted.add(row)

    def read_update(self, server_round: int, client: int) -> codec.TensorFile | GroupRow:
        """A stored update: its other fields decoded, its weights read from disk only when accessed."""
        grouped = self._grouped(server_round).get(client)
        if grouped is None:
            return codec.index_tensors(self._update_path(server_round, client), lazy=("extras", "delta"))
        group, row = grouped
        return group.row(row)

    def update_size(self, server_round: int, client: int) -> int:
        """A stored update's size: its body as received (a group's, shared by all its members)."""
        grouped = self._grouped(server_round).get(client)
        if grouped is None:
            return self._update_path(server_round, client).stat().st_size
        group, _ = grouped
        return group.path.stat().st_size // len(group.members)

    def drop_updates(self, server_round: int) -> None:
        statefiles.discard(self._updates(server_round), self.trash)
        self._groups.pop(server_round, None)
        self._group_seq.pop(server_round, None)

    def drop_updates_through(self, server_round: int) -> None:
        """drop_updates of every round up to `server_round` still on disk."""
        folder = self.root / "updates"
        found = [int(p.name[1:]) for p in folder.iterdir() if p.name[1:].isdigit()] if folder.is_dir() else []
        for stored in sorted(r for r in found if r <= server_round):
            self.drop_updates(stored)

    def stored_clients(self, server_round: int) -> list[int]:
        """The clients whose update for the round is stored, in order."""
        return sorted(set(_clients(self._updates(server_round))) | set(self._grouped(server_round)))

    def _grouped(self, server_round: int) -> dict[int, tuple[GroupFile, int]]:
        """client -> (group file, row) of the round's grouped updates: kept as groups are stored,
        built from the folder on first use after a restart (grouped.py's rule)."""
        index = self._groups.get(server_round)
        if index is None:
            index, singles = {}, set(_clients(self._updates(server_round)))
            for path in group_files(self._updates(server_round)):
                group = GroupFile(path)
                for row, member in enumerate(group.members):
                    client = int(member["client"])
                    if client not in index and client not in singles:
                        index[client] = (group, row)
                        group.adopted.add(row)
                self._group_seq[server_round] = int(path.stem[1:])
            self._groups[server_round] = index
        return index

    # -- updates ahead of their round ---------------------------------------------

    def _early_path(self, server_round: int, client: int) -> Path:
        return self.root / "early" / f"r{server_round}" / f"c{client}.msg"

    def put_early(self, server_round: int, client: int, body: bytes | Path) -> None:
        """Keep an update whose round is not open here yet; a later copy replaces it."""
        _put(self._early_path(server_round, client), body, self.sync)

    def early_clients(self, server_round: int) -> list[int]:
        return _clients(self.root / "early" / f"r{server_round}")

    def adopt_early(self, server_round: int, client: int) -> None:
        """The round opened with this client: its early update becomes a stored one."""
        if not self.has_update(server_round, client):  # a group may hold it already (a restart)
            _put(self._update_path(server_round, client), self._early_path(server_round, client), self.sync)

    def drop_early(self, server_round: int) -> None:
        shutil.rmtree(self.root / "early" / f"r{server_round}", ignore_errors=True)


def _put(dest: Path, body: bytes | Path, sync: bool) -> None:
    """Write bytes, or move a file already fsynced (a spooled update), into place."""
    if isinstance(body, Path):
        statefiles.move_into(body, dest, sync)
    else:
        statefiles.atomic_write(dest, body, sync)


def _clients(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(p.stem[1:]) for p in folder.glob("c*.msg") if p.stem[1:].isdigit())
