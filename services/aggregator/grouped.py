"""A fused group's updates kept as one file, the GroupUpdate as received, and read member by member.

    updates/r<round>/c<client>.msg   one client's update (a ClientUpdate body)
    updates/r<round>/g<seq>.msg      a group's (a GroupUpdate body): member i is row i of each tensor

A client's update is the first stored that holds it: its single file, else the group file of the
lowest sequence number naming it. Files are only added while a round is open and a member already
stored is never stored again, so the rule gives the same answer as the files arrive and when the
folder is scanned after a restart.

A member's tensor is a fresh copy of its row each read. A fold over the members tensor by tensor
(a FedAvg mean) would open the group file once per member and tensor (100 members of a 4-tensor
model: 400 reads a round); so a small stacked tensor (at most CACHE_BYTES) is read whole the first
time one of its rows is asked for and kept until each row the store adopted from the group has been
read once, or another tensor is asked for. A reader that walks one member's tensors and then the
next member's (a clip, a norm) would evict it at each step: the first time another tensor is asked
for while rows of the kept one are unread, the group stops keeping and reads rows alone from then
on. At most one CACHE_BYTES stack per group file beside what a reader holds; the same bytes, so
the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from fedmq.common import codec

GROUP_PREFIX = "g"
CACHE_BYTES = 16 << 20  # the largest stacked tensor a group keeps between reads of its rows (16 MiB)
SHARED = ("round", "base_digest", "learner")  # a group's, every member's
FETCH = ("fetch_seconds", "fetch_bytes")  # the group's model fetch: its first member's (common/groups.py)


class GroupFile:
    """One stored group: where its stacked tensors lie (nothing read), and its members' fields."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors = codec.index_tensors(path, "weights")
        fields = self.tensors.fields
        shared = {k: fields.get(k) for k in SHARED}
        fetch = {k: fields.get(k) for k in FETCH}
        self.members: list[dict[str, Any]] = [{**shared, **(fetch if i == 0 else {}), **dict(m)}
                                              for i, m in enumerate(fields.get("members", []))]

        self.adopted: set[int] = set()  # the rows the store reads as its members' updates
        self._stacked: tuple[str, torch.Tensor, set[int]] | None = None  # name, tensor, adopted rows unread
        self._keeping = True

    def row(self, row: int) -> GroupRow:
        return GroupRow(self, row)

    def read_row(self, name: str, row: int) -> torch.Tensor:
        """Row `row` of tensor `name`, a fresh tensor (the module's docstring says what is kept)."""
        kept = self._stacked
        if kept is not None and kept[0] != name:
            self._stacked = None
            self._keeping = not kept[2]  # asked for another tensor before the rows of this one
            kept = None
        if kept is None:
            dtype, shape = self.tensors.meta(name)
            size = shape.numel() * dtype.itemsize
            if not self._keeping or size > CACHE_BYTES or not len(shape) or not 0 <= row < shape[0]:
                return self.tensors.row(name, row)
            kept = self._stacked = (name, self.tensors[name], set(self.adopted or range(shape[0])))
        _, stacked, unread = kept
        unread.discard(row)
        if not unread:
            self._stacked = None
        return stacked[row].clone()


class GroupRow(Mapping[str, torch.Tensor]):
    """One member's stored update, read as a single file's would be (codec.TensorFile's interface)."""

    maps: ClassVar[Mapping[str, Mapping[str, torch.Tensor]]] = MappingProxyType({})  # no extras, no delta

    def __init__(self, group: GroupFile, row: int) -> None:
        self.group, self.row = group, row
        self.fields = group.members[row]

    @property
    def path(self) -> str:
        return str(self.group.path)

    def meta(self, name: str) -> tuple[torch.dtype, torch.Size]:
        dtype, shape = self.group.tensors.meta(name)
        return dtype, shape[1:]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.group.read_row(name, self.row)

    def __contains__(self, name: object) -> bool:
        return name in self.group.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.group.tensors)

    def __len__(self) -> int:
        return len(self.group.tensors)


def group_files(folder: Path) -> list[Path]:
    """A round's group files, in the order they were stored."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob(f"{GROUP_PREFIX}*.msg") if p.stem[1:].isdigit()]
    return sorted(found, key=lambda p: int(p.stem[1:]))
