"""A fused group's updates kept as one file, the GroupUpdate as received, and read member by member.

    updates/r<round>/c<client>.msg   one client's update (a ClientUpdate body)
    updates/r<round>/g<seq>.msg      a group's (a GroupUpdate body): member i is row i of each tensor

A client's update is the first stored that holds it: its single file, else the group file of the
lowest sequence number naming it. Files are only added while a round is open and a member already
stored is never stored again, so the rule gives the same answer as the files arrive and when the
folder is scanned after a restart.

A member's tensor is a fresh copy of its row each read. The group reads a stacked tensor whole
the first time one of its rows is asked for and keeps it until each row of it has been read once
(or another tensor of the group is read): a fold over the members, tensor by tensor, reads each
group file once per tensor rather than once per member and tensor (100 members of a 4-tensor
model: 4 reads, not 400). That is one tensor per member in memory while a tensor is folded, as
reading each member's row alone and keeping it would be; the same bytes, so the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from fedmq.common import codec

GROUP_PREFIX = "g"
SHARED = ("round", "base_digest", "learner", "fetch_seconds", "fetch_bytes")  # a group's, every member's


class GroupFile:
    """One stored group: where its stacked tensors lie (nothing read), and its members' fields."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors = codec.index_tensors(path, "weights")
        fields = self.tensors.fields
        shared = {k: fields.get(k) for k in SHARED}
        self.members: list[dict[str, Any]] = [{**shared, **dict(m)} for m in fields.get("members", [])]

        self._stacked: tuple[str, torch.Tensor, set[int]] | None = None  # name, tensor, rows not yet read

    def row(self, row: int) -> GroupRow:
        return GroupRow(self, row)

    def read_row(self, name: str, row: int) -> torch.Tensor:
        """Row `row` of tensor `name`, a fresh tensor (see the module's docstring for what is kept)."""
        kept = self._stacked
        if kept is None or kept[0] != name:
            dtype, shape = self.tensors.meta(name)
            if not len(shape) or not 0 <= row < shape[0]:
                raise IndexError(f"tensor {name!r} {list(shape)} has no row {row}")
            kept = self._stacked = (name, self.tensors[name], set(range(shape[0])))
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
