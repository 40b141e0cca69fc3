"""The aggregator deletes a closed round's updates and old checkpoints on a background thread
(statefiles.discard, into <state>/aggregator/.trash); what a stop left there goes when it starts."""

from __future__ import annotations

from pathlib import Path

from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.settings import Settings
from fedmq.services.aggregator.service import AggregatorService
from fedmq.services.aggregator.store import TRASH, JobStore


def test_a_dropped_round_is_gone_from_the_store_at_once(tmp_path: Path) -> None:
    store = JobStore(tmp_path, "job-1")
    store.put_update(1, 0, b"an update")
    store.drop_updates(1)
    assert store.stored_clients(1) == [] and not (store.root / "updates" / "r1").exists()
    assert store.trash == tmp_path / TRASH


def test_what_a_stop_left_in_the_trash_goes_when_the_aggregator_starts(tmp_path: Path) -> None:
    left = tmp_path / "aggregator" / TRASH / "0123abcd"
    left.mkdir(parents=True)
    (left / "c0.msg").write_bytes(b"x" * 100)
    AggregatorService(Settings(state_dir=tmp_path), MemoryBroker().connect()).start()
    assert not (tmp_path / "aggregator" / TRASH).exists()
