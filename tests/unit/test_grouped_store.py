"""Fused groups' updates kept as one file each: read member by member, the same after a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedmq.common import statefiles
from fedmq.common.codec.files import TensorFile
from fedmq.common.errors import StateUnwritable
from fedmq.common.groups import group_of
from fedmq.common.messages import to_wire
from fedmq.services.aggregator import grouped
from fedmq.services.aggregator.kernels.mean import WeightedMean
from fedmq.services.aggregator.store import JobStore
from tests.unit.test_groups import update


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every read of a stored file's tensor data, as the test goes."""
    sizes: list[int] = []
    real = TensorFile._read

    def counted(self: TensorFile, offset: int, size: int) -> memoryview:
        sizes.append(size)
        return real(self, offset, size)

    monkeypatch.setattr(TensorFile, "_read", counted)
    return sizes


def test_a_stored_group_gives_each_new_member_its_row_and_a_restart_reads_the_same(tmp_path: Path) -> None:
    store = JobStore(tmp_path, "job")
    store.put_update(3, 4, to_wire(update(4)))  # a single update first: it wins over a group's copy
    first = [update(c) for c in (2, 4, 6)]
    assert store.put_group(3, to_wire(group_of(first)), [2, 4, 6]) == [2, 6]
    second = [update(c) for c in (6, 8)]  # 6 again: trained again after a crash, in another group
    assert store.put_group(3, to_wire(group_of(second)), [6, 8]) == [8]
    assert store.put_group(3, to_wire(group_of(second)), [6, 8]) == []  # redelivered: nothing written
    assert len(list((tmp_path / "job" / "updates" / "r3").glob("g*.msg"))) == 2

    for reader in (store, JobStore(tmp_path, "job")):  # the same store, and one after a restart
        assert reader.stored_clients(3) == [2, 4, 6, 8]
        assert all(reader.has_update(3, c) for c in (2, 4, 6, 8)) and not reader.has_update(3, 5)
        for client in (2, 4, 6, 8):
            stored, sent = reader.read_update(3, client), update(client)
            assert int(stored.fields["num_examples"]) == sent.num_examples
            assert stored.fields["metrics"] == sent.metrics and stored.maps.get("extras", {}) == {}
            assert list(stored) == list(sent.weights)
            for name, tensor in sent.weights.items():
                assert stored.meta(name) == (tensor.dtype, tensor.shape)
                assert torch.equal(stored[name], tensor)
        assert reader.read_update(3, 6).path.endswith("g1.msg")  # its first group's row
        sizes = {f"g{n}": (tmp_path / "job" / "updates" / "r3" / f"g{n}.msg").stat().st_size for n in (1, 2)}
        assert reader.update_size(3, 2) == reader.update_size(3, 6) == sizes["g1"] // 3  # a member's share
        assert reader.update_size(3, 8) == sizes["g2"] // 2
        row = reader.read_update(3, 8)
        row["w"].add_(1)  # a fresh tensor each read, as a single update's: an edit changes nothing stored
        assert torch.equal(row["w"], update(8).weights["w"])
    store.drop_updates(3)
    assert store.stored_clients(3) == [] and not store.has_update(3, 2)


def test_an_early_copy_of_a_client_a_group_holds_is_not_adopted_over_it(tmp_path: Path) -> None:
    # A restart between RoundOpen's record and its handling: a group came first, then the RoundOpen
    # adopts the round's early updates; the group's copy stays the client's, before and after.
    store = JobStore(tmp_path, "job")
    store.put_early(3, 2, to_wire(update(2, num_examples=99)))
    store.put_group(3, to_wire(group_of([update(2), update(4)])), [2, 4])
    store.adopt_early(3, 2)
    for reader in (store, JobStore(tmp_path, "job")):
        assert int(reader.read_update(3, 2).fields["num_examples"]) == update(2).num_examples


def test_a_fold_over_a_group_reads_each_stacked_tensor_once_and_gives_the_rows_bits(
    tmp_path: Path, reads: list[int]
) -> None:
    clients = list(range(10))
    sent = [update(c) for c in clients]
    store = JobStore(tmp_path, "job")
    assert store.put_group(1, to_wire(group_of(sent)), clients) == clients
    rows = [store.read_update(1, c) for c in clients]
    mean = WeightedMean([(row, float(u.num_examples)) for row, u in zip(rows, sent, strict=True)])
    expected = WeightedMean([(u.weights, float(u.num_examples)) for u in sent])
    for name in sent[0].weights:
        assert torch.equal(mean[name], expected[name]), name
    assert len(reads) == len(sent[0].weights), "one read of each stacked tensor, not one per member"
    first = rows[0]["w"]
    first.add_(1)  # a fresh tensor each read: an edit changes nothing kept or stored
    assert torch.equal(rows[0]["w"], sent[0].weights["w"])


def test_a_reader_walking_each_members_tensors_in_turn_reads_rows_not_whole_stacks_again(
    tmp_path: Path, reads: list[int]
) -> None:
    """A clip or a norm reads one member's tensors, then the next member's: the group stops keeping
    stacks at the first sign, so at most one stack is read whole, the rest row by row."""
    clients = list(range(10))
    sent = [update(c) for c in clients]
    store = JobStore(tmp_path, "job")
    store.put_group(1, to_wire(group_of(sent)), clients)
    for client, one in zip(clients, sent, strict=True):
        row = store.read_update(1, client)
        for name, tensor in one.weights.items():
            assert torch.equal(row[name], tensor)
    rows = sum(t.numel() * t.element_size() for t in sent[0].weights.values()) * len(clients)
    stack = sent[0].weights["w"].numel() * sent[0].weights["w"].element_size() * len(clients)
    assert sum(reads) <= rows + stack, (sum(reads), rows, stack)


def test_a_stack_over_the_cache_size_is_read_row_by_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: list[int]
) -> None:
    monkeypatch.setattr(grouped, "CACHE_BYTES", 8)
    clients = [3, 4, 5]
    sent = [update(c) for c in clients]
    store = JobStore(tmp_path, "job")
    store.put_group(1, to_wire(group_of(sent)), clients)
    mean = WeightedMean([(store.read_update(1, c), 1.0) for c in clients])
    assert torch.equal(mean["w"], WeightedMean([(u.weights, 1.0) for u in sent])["w"])
    assert reads == [sent[0].weights["w"].numel() * 4] * 3, "each member's row alone"


def test_a_groups_kept_stack_is_let_go_once_every_adopted_row_is_read(tmp_path: Path) -> None:
    store = JobStore(tmp_path, "job")
    store.put_update(1, 4, to_wire(update(4)))  # stored alone first: the group's copy of 4 is not adopted
    store.put_group(1, to_wire(group_of([update(c) for c in (2, 4, 6)])), [2, 4, 6])
    for client in (2, 6):
        store.read_update(1, client)["w"]
    group, _ = store._grouped(1)[2]
    assert group.adopted == {0, 2} and group._stacked is None


def test_a_staged_group_is_stored_only_at_the_commit_and_a_failed_commit_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JobStore(tmp_path, "job")
    first = [update(c) for c in (2, 4)]
    assert store.stage_group(3, to_wire(group_of(first)), [2, 4]) == [2, 4]
    assert store.has_update(3, 2), "a second copy in the same commit is a duplicate"
    assert store.stage_group(3, to_wire(group_of([update(4), update(6)])), [4, 6]) == [6]
    assert JobStore(tmp_path, "job").stored_clients(3) == [], "nothing stored before the commit"
    store.commit_staged()
    for reader in (store, JobStore(tmp_path, "job")):
        assert reader.stored_clients(3) == [2, 4, 6]
        assert torch.equal(reader.read_update(3, 6)["w"], update(6).weights["w"])

    def refused(pairs: object, sync: bool = True) -> None:
        raise StateUnwritable("disk", 28, "No space left on device")

    monkeypatch.setattr(statefiles, "commit", refused)
    assert store.stage_group(3, to_wire(group_of([update(8)])), [8]) == [8]
    with pytest.raises(StateUnwritable):
        store.commit_staged()
    assert not store.has_update(3, 8) and store.stored_clients(3) == [2, 4, 6]
    assert not list((tmp_path / "job" / "updates" / "r3").glob(".*")), "no temporary file left"
