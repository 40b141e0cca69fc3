"""Per-client state in memory, versioned by round as the aggregator's ClientStore keeps it on disk.

The engine keeps a strategy's client state and topk's residuals here between checkpoints and
writes them to the job's folder with each checkpoint (`flush`), in ClientStore's own layout, so
that a resumed engine (`load`) reads exactly what it held:

    flush at round r:  write the versions held that the disk lacks ─▶ [job.json names round r]
                       ─▶ `prune_disk`: drop the disk's versions no longer held
    load at round r:   every version on disk, less those written after round r
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from fedmq.common.strategy.clients import SHARED, ClientStore

Owner = int | str  # a client id, or SHARED


class MemoryClientStore(ClientStore):
    """ClientStore's interface over a dict; tensors are copied in and out (a Task may edit its own)."""

    def __init__(self, disk: ClientStore) -> None:
        super().__init__(disk.root)
        self.disk = disk
        self._held: dict[Owner, dict[int, dict[str, torch.Tensor]]] = {}

    def write(self, server_round: int, client: int, state: Mapping[str, torch.Tensor]) -> None:
        self._held.setdefault(client, {})[server_round] = _copied(state)

    def write_shared(self, server_round: int, state: Mapping[str, torch.Tensor]) -> None:
        self._held.setdefault(SHARED, {})[server_round] = _copied(state)

    def read(self, client: int, before: int) -> dict[str, torch.Tensor]:
        return {**self._newest(SHARED, before), **self._newest(client, before)}

    def versions(self, client: int | str) -> list[int]:
        return sorted(self._held.get(client, {}))

    def clients(self) -> list[int]:
        return sorted(c for c, versions in self._held.items() if isinstance(c, int) and versions)

    def discard_from(self, server_round: int) -> None:
        for versions in self._held.values():
            for r in [r for r in versions if r >= server_round]:
                del versions[r]

    def prune(self, committed: int, clients: Iterable[int]) -> None:
        owners: list[Owner] = [*clients, SHARED]
        for owner in owners:
            versions = self._held.get(owner, {})
            kept = sorted(r for r in versions if r <= committed)
            for r in kept[:-1]:
                del versions[r]

    def drop(self) -> None:
        self._held.clear()
        self.disk.drop()

    def version(self, client: int | str, server_round: int) -> dict[str, torch.Tensor]:
        """The state held for `client` (or SHARED) at round `server_round` exactly; KeyError if none."""
        return _copied(self._held[client][server_round])

    def remove(self, client: int | str, server_round: int) -> None:
        self._held.get(client, {}).pop(server_round, None)

    def _newest(self, client: int | str, before: int) -> dict[str, torch.Tensor]:
        versions = self._held.get(client, {})
        rounds = [r for r in versions if r < before]
        return _copied(versions[max(rounds)]) if rounds else {}

    # -- with the engine's checkpoints ------------------------------------------------

    def flush(self) -> None:
        """Every version held onto the disk that the disk does not have yet (same round, same state)."""
        for owner, versions in self._held.items():
            on_disk = set(self.disk.versions(owner))
            for r, state in versions.items():
                if r not in on_disk:
                    if owner == SHARED:
                        self.disk.write_shared(r, state)
                    else:
                        self.disk.write(r, int(owner), state)

    def prune_disk(self) -> None:
        """Drop the disk's versions that this store no longer holds (after the checkpoint is committed)."""
        owners: list[Owner] = [*self.disk.clients(), SHARED]
        for owner in owners:
            held = self._held.get(owner, {})
            for r in self.disk.versions(owner):
                if r not in held:
                    self.disk.remove(owner, r)

    def load(self, committed: int) -> None:
        """What the disk holds as of round `committed` (a later, uncommitted flush's versions left out)."""
        self._held.clear()
        owners: list[Owner] = [*self.disk.clients(), SHARED]
        for owner in owners:
            for r in self.disk.versions(owner):
                if r <= committed:
                    self._held.setdefault(owner, {})[r] = self.disk.version(owner, r)


def _copied(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in state.items()}
