"""Columns of stored updates: large tensors read ahead on other threads, and the mean kernel reading
its inputs only as their type says."""

from __future__ import annotations

import ast
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from fedmq.common.codec import index_tensors, packb, readahead
from fedmq.common.codec.files import TensorFile
from fedmq.services.aggregator.kernels.mean import WeightedMean


def files(tmp_path: Path, count: int, numel: int) -> list[TensorFile]:
    out = []
    for i in range(count):
        path = tmp_path / f"u{i}.msg"
        path.write_bytes(packb({"weights": {"w": torch.full((numel,), float(i))}}))
        out.append(index_tensors(path))
    return out


@pytest.mark.parametrize(("numel", "threads"), [(8, {"MainThread"}), (1 << 18, {"fold-read"})])
def test_a_large_tensor_of_each_file_is_read_on_the_readers_threads_a_small_one_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, numel: int, threads: set[str]
) -> None:
    readers: list[str] = []
    real = TensorFile.__getitem__

    def recording(self: TensorFile, name: str) -> torch.Tensor:
        readers.append(threading.current_thread().name.partition("_")[0])
        return real(self, name)

    monkeypatch.setattr(TensorFile, "__getitem__", recording)
    column = list(readahead.read_column(files(tmp_path, 4, numel), "w"))
    assert [float(t[0]) for t in column] == [0.0, 1.0, 2.0, 3.0]
    assert set(readers) == threads


class Column(Mapping[str, torch.Tensor]):
    """A result that says how a column of its kind is read, and records that it was asked."""

    asked: list[tuple[str, int]] = []

    def __init__(self, value: float) -> None:
        self.value = value

    @staticmethod
    def read_column(states: Sequence[Column], name: str) -> Generator[torch.Tensor]:
        Column.asked.append((name, len(states)))
        return (state[name] for state in states)

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.full((3,), self.value)

    def __iter__(self) -> Iterator[str]:
        return iter(["w"])

    def __len__(self) -> int:
        return 1


def test_the_mean_reads_a_column_as_its_inputs_type_says_and_mixed_inputs_one_lookup_at_a_time() -> None:
    Column.asked.clear()
    mean = WeightedMean([(Column(1.0), 1.0), (Column(4.0), 2.0)])
    assert torch.equal(mean["w"], torch.full((3,), 3.0))
    assert Column.asked == [("w", 2)]
    mixed = WeightedMean([(Column(1.0), 1.0), ({"w": torch.full((3,), 4.0)}, 2.0)])
    assert torch.equal(mixed["w"], torch.full((3,), 3.0))
    assert Column.asked == [("w", 2)]


def test_the_mean_kernel_imports_nothing_that_reads_files_or_starts_threads() -> None:
    import fedmq.services.aggregator.kernels.mean as kernel

    tree = ast.parse(Path(kernel.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    io = {name for name in imported if name.split(".")[0] in ("concurrent", "threading", "os", "io")}
    assert not io and not any(name.startswith("fedmq.common.codec") for name in imported), imported
    calls = [node.func for node in ast.walk(tree) if isinstance(node, ast.Call)]
    assert not any(isinstance(func, ast.Name) and func.id == "open" for func in calls)
