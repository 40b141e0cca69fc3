"""The fused group's data bank: the same padded, stacked batches as cutting each client's own."""

from __future__ import annotations

import torch

from fedmq.common.task.bank import LIMIT_BYTES, Bank
from fedmq.common.task.batches import source
from fedmq.common.task.fused import _pad, _stack

CPU = torch.device("cpu")


def datas(sizes: list[int], form: str) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in sizes:
        x, y = torch.randn(n, 3, 2, generator=g), torch.randint(0, 9, (n,), generator=g)
        out.append({"tensor": x, "tuple": (x, y), "list": [x, y], "dict": {"y": y, "x": x}}[form])
    return out


def test_rows_are_each_clients_batch_padded_with_its_first_example_and_stacked() -> None:
    sizes = [5, 1, 9, 4]
    for form in ("tensor", "tuple", "list", "dict"):
        data = datas(sizes, form)
        sources = [source(d) for d in data]
        bank = Bank.of(sources, CPU)
        assert bank is not None, form
        g = torch.Generator().manual_seed(2)
        slices = [torch.randperm(n, generator=g)[:3] for n in sizes]
        index, real = bank.index([0, 1, 2, 3], slices, [6] * 4)
        batches, mask = bank.take(index, 4, 6), real.to(torch.float32).reshape(4, 6)
        expected = _stack([_pad(src.batch(s), 6) for src, s in zip(sources, slices, strict=True)], CPU)
        for got, want in zip(_leaves(batches), _leaves(expected), strict=True):
            assert torch.equal(got, want), form
        assert mask.tolist() == [[1.0] * min(3, n) + [0.0] * (6 - min(3, n)) for n in sizes]
        assert all(torch.equal(a, b) for a, b in zip(
            _leaves(bank.batch(2, slices[2])), _leaves(sources[2].batch(slices[2])), strict=True))
        if form == "dict":
            assert list(batches) == ["y", "x"], "the Task's key order"


def test_one_index_serves_batches_of_several_lengths_in_order() -> None:
    sizes = [5, 1, 9, 4]
    sources = [source(d) for d in datas(sizes, "tuple")]
    bank = Bank.of(sources, CPU)
    assert bank is not None
    g = torch.Generator().manual_seed(3)
    clients = [2, 0, 3, 2, 1]
    kept = [9, 3, 4, 2, 1]
    slices = [torch.randperm(sizes[c], generator=g)[:k] for c, k in zip(clients, kept, strict=True)]
    lengths = [16, 4, 4, 2, 8]
    rows, real = bank.index(clients, slices, lengths)
    assert rows.shape == real.shape == (sum(lengths),)
    at = 0
    for client, cut, length in zip(clients, slices, lengths, strict=True):
        want = _pad(sources[client].batch(cut), length)
        got = bank.take(rows[at:at + length], 1, length)
        for a, b in zip(_leaves(got), _leaves(want), strict=True):
            assert torch.equal(a[0], b), (client, length)
        assert real[at:at + length].tolist() == [True] * len(cut) + [False] * (length - len(cut))
        at += length


def test_a_bank_needs_tensors_of_one_structure_shape_and_dtype() -> None:
    x = torch.randn(4, 3)
    assert Bank.of([source(x), source(torch.randn(2, 4))], CPU) is None, "another example shape"
    assert Bank.of([source(x), source(x.double())], CPU) is None, "another dtype"
    assert Bank.of([source((x, x)), source({"a": x, "b": x})], CPU) is None, "another structure"
    dataset = torch.utils.data.TensorDataset(x)
    assert Bank.of([source(dataset)], CPU) is None, "a Dataset goes the general way"
    large = torch.zeros(LIMIT_BYTES // 4 + 1, dtype=torch.float32)
    assert Bank.of([source(large)], CPU) is None, "data above the limit goes the general way"


def _leaves(batch: object) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return list(batch.values())
    assert isinstance(batch, tuple | list)
    return list(batch)
