"""A fused group's updates kept as one file, the GroupUpdate as received, and read member by member.

    updates/r<round>/c<client>.msg   one client's update (a ClientUpdate body)
    updates/r<round>/g<seq>.msg      a group's (a GroupUpdate body): member i is row i of each tensor

A client's update is the first stored that holds it: its single file, else the group file of the
lowest sequence number naming it. Files are only added while a round is open and a member already
stored is never stored again, so the rule gives the same answer as the files arrive and when the
folder is scanned after a restart. A member's tensors are read from disk one row at a time, as a
single update's are one tensor at a time: a fresh tensor each read, nothing kept.
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

    def row(self, row: int) -> GroupRow:
        return GroupRow(self, row)


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
        return self.group.tensors.row(name, self.row)

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
