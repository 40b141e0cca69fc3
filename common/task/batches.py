"""Turning a Task's data into batches: tensors, dicts of tensors, datasets, or iterables as given.

    (x, y)           batch = (x[idx], y[idx])               indexable: fedmq draws the order
    {"x": x, ...}    batch = {"x": x[idx], ...}             indexable
    Dataset          batch = default_collate([ds[i] ...])   indexable (map-style, sized)
    DataLoader, ...  batch = whatever it yields             iterated as given, every epoch

An indexable source is shuffled with the generator fedmq hands the client, so a client's
batches are the same in every process; an iterable one is the Task's own business.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class DataError(TypeError):
    """Data a Task returned is not something fedmq can batch; the message says what is expected."""


@dataclass(frozen=True)
class Source:
    """A client's data, with how to count it and cut batches from it."""

    data: Any
    size: int | None  # None: an iterable of unknown length
    indexable: bool

    def batch(self, idx: torch.Tensor) -> Any:
        """The examples at `idx` (a 1-D int64 tensor) as one batch."""
        data = self.data
        if isinstance(data, torch.Tensor):
            return data[idx]
        if isinstance(data, tuple | list):
            return type(data)(t[idx] for t in data)
        if isinstance(data, Mapping):
            return {k: v[idx] for k, v in data.items()}
        from torch.utils.data import default_collate

        return default_collate([data[i] for i in idx.tolist()])

    def batches(self, batch_size: int, generator: torch.Generator | None) -> Iterator[Any]:
        """One epoch: shuffled by `generator` (in order when None) if indexable, else as given."""
        if not self.indexable:
            yield from self.data
            return
        assert self.size is not None
        if generator is None and self._contiguous():
            for start in range(0, self.size, batch_size):  # in order: a copy of a slice, not a gather
                yield self.slice(start, start + batch_size)
            return
        order = (
            torch.randperm(self.size, generator=generator)
            if generator is not None
            else torch.arange(self.size)
        )
        for indices in cut(order, batch_size):
            yield self.batch(indices)

    def _contiguous(self) -> bool:
        """Whether the data are contiguous tensors: a batch sliced from them is laid out as a gather's."""
        data = self.data
        tensors = (data.values() if isinstance(data, Mapping) else data if isinstance(data, tuple | list)
                   else [data])
        return all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in tensors)

    def slice(self, start: int, stop: int) -> Any:
        """Examples start..stop-1 of tensor data, copied as `batch` copies (a loss may write into
        its batch: never into the client's data)."""
        data = self.data
        if isinstance(data, torch.Tensor):
            return data[start:stop].clone()
        if isinstance(data, tuple | list):
            return type(data)(t[start:stop].clone() for t in data)
        return {k: v[start:stop].clone() for k, v in data.items()}


def source(data: Any, what: str = "data") -> Source:
    """Classify a Task's data; DataError if it is none of the forms in the module docstring."""
    if isinstance(data, torch.Tensor):
        return Source(data, _first_dim([data], what), True)
    if isinstance(data, tuple | list) and data and all(isinstance(t, torch.Tensor) for t in data):
        return Source(data, _first_dim(data, what), True)
    if isinstance(data, Mapping) and data and all(isinstance(t, torch.Tensor) for t in data.values()):
        return Source(data, _first_dim(list(data.values()), what), True)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, str | bytes):
        from torch.utils.data import Dataset

        if isinstance(data, Dataset):
            return Source(data, len(data), True)  # type: ignore[arg-type]  # checked: has __len__
    if hasattr(data, "__iter__") and not isinstance(data, str | bytes | Mapping):
        size = len(data.dataset) if hasattr(data, "dataset") and hasattr(data.dataset, "__len__") else None
        return Source(data, size, False)
    raise DataError(
        f"{what} is a {type(data).__name__}; give a tuple or dict of tensors with a common first "
        "dimension, a map-style torch Dataset, or an iterable of batches (a DataLoader)"
    )


def _first_dim(tensors: Sequence[torch.Tensor], what: str) -> int:
    sizes = {int(t.shape[0]) if t.dim() else -1 for t in tensors}
    if len(sizes) != 1 or -1 in sizes:
        shapes = [tuple(t.shape) for t in tensors]
        raise DataError(
            f"{what}: tensors must share their first dimension (one row per example), got {shapes}"
        )
    return sizes.pop()


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a batch (tensors, tuples, lists, dicts of them) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def batch_size_of(batch: Any) -> int:
    """How many examples a batch holds: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, tuple | list) else []
    for item in items:
        size = batch_size_of(item)
        if size:
            return size
    raise DataError(f"cannot tell how many examples a batch of type {type(batch).__name__} holds")


def cut(order: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    """An epoch's order of example indices in batches of `batch_size` (the last one shorter); one
    batch is the whole order, not a slice of it (an operation less a step)."""
    size = order.shape[0]
    if 0 < size <= batch_size:
        yield order
        return
    for start in range(0, size, batch_size):
        yield order[start : start + batch_size]
