"""A fused group's training data in one place: every client's examples stacked end to end on the device.

    bank[k]    (n_0 + n_1 + ... , *shape_k)    tensor k of every client's data, client i from offset[i]
    a step     index (G, L): row j = client j's batch (its order's slice, shifted by its offset),
               padded past its size with its batch's first example; one index_select per tensor
               (the index of a whole plan's steps is made at once, then cut into them)

The same examples as cutting each client's batch from its own data, padding it with copies of its
first example and stacking the group's batches (fused.py's general path), so the same bits, in a
handful of tensor operations per step instead of several per client. Only for data given as
tensors (a tensor, a tuple or list of them, a dict of them) whose examples match in shape and
dtype across the group; anything else (a Dataset) goes the general way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import torch

from fedmq.common.task.batches import Source

__all__ = ["LIMIT_BYTES", "Bank"]

LIMIT_BYTES = 256 * 1024**2  # a group's data copied whole to the device at most (digits' 100 clients: 0.4 MB)


class Bank:
    """The group's data on `device`, and each client's first row in it."""

    def __init__(self, template: Any, parts: list[torch.Tensor], offsets: list[int]) -> None:
        self.template = template  # the data's structure: a tensor, a tuple or list, or a dict's keys
        self.parts = parts
        self.offsets = torch.tensor(offsets, dtype=torch.int64)

    @classmethod
    def of(cls, sources: Sequence[Source], device: torch.device) -> Bank | None:
        """The group's bank; None when the data is not tensors of one structure, shape and dtype, or
        when it is larger than LIMIT_BYTES (a copy of it on the device is not counted in the fused
        memory budget: large data goes the general way, a batch at a time)."""
        flat = [_flatten(src.data) for src in sources]
        if any(f is None for f in flat):
            return None
        if sum(t.numel() * t.element_size() for f in flat if f is not None for t in f) > LIMIT_BYTES:
            return None
        layouts = {tuple((tuple(t.shape[1:]), t.dtype) for t in f) for f in flat if f is not None}
        templates = {_template(src.data) for src in sources}
        if len(layouts) != 1 or len(templates) != 1:
            return None
        columns = list(zip(*[f for f in flat if f is not None], strict=True))
        parts = [torch.cat(column).to(device) for column in columns]
        sizes = [src.size or 0 for src in sources]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return cls(templates.pop(), parts, offsets)

    def index(
        self, clients: Sequence[int], slices: Sequence[torch.Tensor], lengths: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each batch lies in the bank, on the host, for a whole plan at once: batch j (`slices[j]`,
        indices into client `clients[j]`'s own data) padded to `lengths[j]` with its first example,
        the batches' rows end to end; and the bool mask of the real ones. `take` gathers them on the
        device. About a dozen tensor operations, whatever the number of batches."""
        sizes = [s.shape[0] for s in slices]
        per_batch = torch.tensor([sizes, lengths, list(accumulate(sizes, initial=0))[:-1],
                                  list(accumulate(lengths, initial=0))[:-1]], dtype=torch.int64)
        flat = torch.cat(list(slices)) + torch.repeat_interleave(self.offsets[list(clients)], per_batch[0])
        batch = torch.repeat_interleave(per_batch[1])  # each row's batch
        size, _, start, row_start = per_batch[:, batch]
        position = torch.arange(len(batch)) - row_start
        real = position < size
        return flat[start + position * real], real  # a padding row: its batch's first example

    def take(self, at: torch.Tensor, count: int, length: int) -> Any:
        """The batches `index` named, given as its flattened rows on the bank's device."""
        taken = [part.index_select(0, at).reshape(count, length, *part.shape[1:]) for part in self.parts]
        return _rebuild(self.template, taken)

    def batch(self, client: int, rows: torch.Tensor) -> Any:
        """One client's batch of its examples `rows`, unpadded."""
        at = (rows + self.offsets[client]).to(self.parts[0].device)
        return _rebuild(self.template, [part.index_select(0, at) for part in self.parts])


def _flatten(data: Any) -> list[torch.Tensor] | None:
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, tuple | list) and all(isinstance(t, torch.Tensor) for t in data):
        return list(data)
    if isinstance(data, Mapping) and all(isinstance(t, torch.Tensor) for t in data.values()):
        return list(data.values())
    return None


def _template(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return "tensor"
    if isinstance(data, tuple | list):
        return (type(data), len(data))
    return tuple(data)  # its keys, in the Task's order


def _rebuild(template: Any, parts: list[torch.Tensor]) -> Any:
    if template == "tensor":
        return parts[0]
    if isinstance(template, tuple) and template and isinstance(template[0], type):
        kind, _ = template
        return kind(parts)
    return dict(zip(template, parts, strict=True))
