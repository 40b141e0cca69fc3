"""The engine's client state in memory answers as the aggregator's on disk, and survives its checkpoints."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from fedmq.common.strategy.clients import SHARED, ClientStore
from fedmq.services.engine.clientstate import MemoryClientStore


def state(value: float) -> dict[str, torch.Tensor]:
    return {"c": torch.full((3,), value)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_memory_and_disk_stores_answer_alike_through_rounds_of_writes_discards_and_prunes(
    tmp_path: Path,
) -> None:
    disk = ClientStore(tmp_path / "disk")
    memory = MemoryClientStore(ClientStore(tmp_path / "flushed"))
    rng = random.Random(7)
    for server_round in range(1, 30):
        if rng.random() < 0.2:  # an attempt that never committed
            for store in (disk, memory):
                store.write(server_round, 0, state(-1.0))
                store.discard_from(server_round)
        written = rng.sample(range(6), 3)
        for store in (disk, memory):
            for client in written:
                store.write(server_round, client, state(server_round * 10 + client))
            if server_round % 4 == 0:
                store.write_shared(server_round, {"s": torch.full((2,), float(server_round))})
            store.prune(server_round, written)
        for client in range(6):
            assert same(memory.read(client, server_round + 1), disk.read(client, server_round + 1))
            assert memory.versions(client) == disk.versions(client)
        assert memory.clients() == disk.clients()
        assert memory.versions(SHARED) == disk.versions(SHARED)
        for client in range(6):
            for r in disk.versions(client):
                assert same(memory.version(client, r), disk.version(client, r))
    for store in (disk, memory):  # removing one version, in memory as on disk
        store.remove(written[0], store.versions(written[0])[-1])
    assert memory.versions(written[0]) == disk.versions(written[0])
    assert not any((tmp_path / "flushed").rglob("*.safetensors")), "memory's remove touched no disk"


def test_a_read_state_is_a_copy_a_task_may_change(tmp_path: Path) -> None:
    memory = MemoryClientStore(ClientStore(tmp_path))
    memory.write(1, 3, state(1.0))
    memory.read(3, 2)["c"].add_(5)
    assert same(memory.read(3, 2), state(1.0))


def test_flushed_state_loads_back_as_of_its_round_without_a_later_uncommitted_flush(tmp_path: Path) -> None:
    memory = MemoryClientStore(ClientStore(tmp_path))
    memory.write(2, 1, state(2.0))
    memory.write_shared(2, {"s": torch.ones(1)})
    memory.flush()
    memory.write(4, 1, state(4.0))
    memory.prune(4, [1])
    memory.flush()  # written, but the journal still names round 2: a crash came before it moved on
    back = MemoryClientStore(ClientStore(tmp_path))
    back.load(2)
    assert back.versions(1) == [2]
    assert same(back.read(1, 3), {"s": torch.ones(1), **state(2.0)})
    memory.prune_disk()  # once round 4 is committed, the disk keeps what memory keeps
    assert ClientStore(tmp_path).versions(1) == [4]
