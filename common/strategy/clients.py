"""Per-client strategy state on disk, one file per client and round, never all in memory.

    <state>/aggregator/<job>/clients/c<client>/r<round>.safetensors
    <state>/aggregator/<job>/clients/shared/r<round>.safetensors     (what every client gets)

A version written while closing round r is what the client gets the next time it is picked
(any round after r), merged with the newest shared version written before that round.
Versions are written before the round commits and pruned after it, so a crash in between
re-aggregates from the same inputs and writes the same files again:

    close r:  discard versions ≥ r (an earlier attempt's) ─▶ write r ─▶ commit r ─▶ prune < r
    read for round t: the newest version written at a round < t
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fedmq.common.checkpoint import load_state, save_state

if TYPE_CHECKING:
    import torch


SHARED = "shared"  # the folder of the state every client gets


class ClientStore:
    """The strategy's per-client tensors of one job, versioned by round."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, server_round: int, client: int, state: Mapping[str, torch.Tensor]) -> None:
        """Keep `state` as what `client` gets after round `server_round` (atomic, durable)."""
        save_state(self._path(client, server_round), state, {"round": str(server_round)})

    def write_shared(self, server_round: int, state: Mapping[str, torch.Tensor]) -> None:
        """Keep `state` as what every client gets, beside its own, in the rounds after `server_round`."""
        save_state(self._path(SHARED, server_round), state, {"round": str(server_round)})

    def read(self, client: int, before: int) -> dict[str, torch.Tensor]:
        """What `client` gets in round `before`: the newest shared and own states written before it."""
        return {**self._newest(SHARED, before), **self._newest(client, before)}

    def versions(self, client: int | str) -> list[int]:
        """The rounds with a stored version for `client` (or SHARED), in order."""
        folder = self._folder(client)
        if not folder.is_dir():
            return []
        names = (p.stem[1:] for p in folder.glob("r*.safetensors"))
        return sorted(int(n) for n in names if n.isdigit())

    def clients(self) -> list[int]:
        """The clients with any stored state."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name[1:]) for p in self.root.glob("c*") if p.name[1:].isdigit())

    def discard_from(self, server_round: int) -> None:
        """Drop versions of round `server_round` and later: left by an attempt that never committed."""
        owners: list[int | str] = [*self.clients(), SHARED]
        for client in owners:
            for r in self.versions(client):
                if r >= server_round:
                    self._path(client, r).unlink(missing_ok=True)

    def prune(self, committed: int, clients: Iterable[int]) -> None:
        """For `clients` and the shared state, drop versions older than the newest one at or before
        round `committed`."""
        owners: list[int | str] = [*clients, SHARED]
        for client in owners:
            kept = [r for r in self.versions(client) if r <= committed]
            for r in kept[:-1]:
                self._path(client, r).unlink(missing_ok=True)

    def drop(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def version(self, client: int | str, server_round: int) -> dict[str, torch.Tensor]:
        """The state `client` (or SHARED) was given at round `server_round` exactly."""
        return load_state(self._path(client, server_round))[0]

    def remove(self, client: int | str, server_round: int) -> None:
        """Drop one version."""
        self._path(client, server_round).unlink(missing_ok=True)

    def _newest(self, client: int | str, before: int) -> dict[str, torch.Tensor]:
        rounds = [r for r in self.versions(client) if r < before]
        return load_state(self._path(client, max(rounds)))[0] if rounds else {}

    def _folder(self, client: int | str) -> Path:
        return self.root / (SHARED if client == SHARED else f"c{client}")

    def _path(self, client: int | str, server_round: int) -> Path:
        return self._folder(client) / f"r{server_round}.safetensors"
