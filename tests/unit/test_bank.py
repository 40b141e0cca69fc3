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
        index, real = bank.index([0, 1, 2, 3], slices, 6)
        batches, mask = bank.take(index.reshape(-1), 4, 6), real.to(torch.float32)
        expected = _stack([_pad(src.batch(s), 6) for src, s in zip(sources, slices, strict=True)], CPU)
        for got, want in zip(_leaves(batches), _leaves(expected), strict=True):
            assert torch.equal(got, want), form
        assert mask.tolist() == [[1.0] * min(3, n) + [0.0] * (6 - min(3, n)) for n in sizes]
        assert all(torch.equal(a, b) for a, b in zip(
            _leaves(bank.batch(2, slices[2])), _leaves(sources[2].batch(slices[2])), strict=True))
        if form == "dict":
            assert list(batches) == ["y", "x"], "the Task's key order"


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
