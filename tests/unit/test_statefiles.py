"""State writes on a real full disk: a clear error, the old file whole, no half-written file, then room again.

The disk is a 1 MiB tmpfs, where the machine lets the test mount one (as root); elsewhere these
tests skip and tests/integration/test_disk_trouble.py still injects ENOSPC into the same writes.
"""

from __future__ import annotations

import errno
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedmq.common import statefiles
from fedmq.common.checkpoint import load_state, save_state
from fedmq.common.errors import StateUnwritable


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False, capture_output=True)


def fill(disk: Path) -> Path:
    """Take every free byte; the ballast file is the room to give back."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return ballast


def temps(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith(statefiles.TEMP_SUFFIX)]


def test_a_write_to_a_full_disk_names_path_and_errno_and_keeps_the_old_file(tiny_disk: Path) -> None:
    target = tiny_disk / "job" / "rounds.json"
    statefiles.atomic_write(target, b'{"0": "old"}')
    ballast = fill(tiny_disk)
    with pytest.raises(StateUnwritable) as caught:
        statefiles.atomic_write(target, b"x" * 100_000)
    assert (caught.value.errno, caught.value.path) == (errno.ENOSPC, str(target))
    assert target.read_bytes() == b'{"0": "old"}'
    assert temps(tiny_disk) == [], "the half-written temporary file is gone, and its space with it"
    ballast.unlink()
    statefiles.atomic_write(target, b"x" * 100_000)
    assert target.read_bytes() == b"x" * 100_000


def test_a_checkpoint_on_a_full_disk_is_never_torn(tiny_disk: Path) -> None:
    path = tiny_disk / "checkpoints" / "a.safetensors"
    save_state(path, {"w": torch.ones(4)})
    ballast = fill(tiny_disk)
    with pytest.raises(StateUnwritable) as caught:
        save_state(path, {"w": torch.zeros(100_000)})
    assert caught.value.errno == errno.ENOSPC
    assert torch.equal(load_state(path)[0]["w"], torch.ones(4)), "the old checkpoint reads back whole"
    assert temps(tiny_disk) == []
    ballast.unlink()
    save_state(path, {"w": torch.zeros(100_000)})
    assert torch.equal(load_state(path)[0]["w"], torch.zeros(100_000))


def test_a_temporary_file_a_crash_left_is_never_read_and_is_swept(tmp_path: Path) -> None:
    target = tmp_path / "job" / "closed.json"
    statefiles.atomic_write(target, b'{"round": 1}')
    torn = statefiles.temp_path(target).with_name(f".{target.name}.99999{statefiles.TEMP_SUFFIX}")
    torn.write_bytes(b'{"round": 2')  # half a write, as a crash leaves it
    assert target.read_bytes() == b'{"round": 1}'
    assert statefiles.remove_temps(tmp_path) == 1
    assert temps(tmp_path) == [] and target.exists()


def test_a_folder_that_cannot_be_made_is_unwritable_state(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_bytes(b"")  # a file where the folder should be
    with pytest.raises(StateUnwritable) as caught:
        statefiles.atomic_write(tmp_path / "checkpoints" / "a.json", b"{}")
    assert caught.value.errno in (errno.EEXIST, errno.ENOTDIR)


def test_writes_without_sync_call_no_fsync_and_still_replace_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state" / "rounds.json"
    statefiles.atomic_write(target, b"old")  # synced: fsync is still there
    synced: list[int] = []
    monkeypatch.setattr(statefiles.os, "fsync", synced.append)
    statefiles.atomic_write(target, b"new", sync=False)
    save_state(tmp_path / "state" / "w.safetensors", {"w": torch.ones(3)}, sync=False)
    spooled = tmp_path / "spool.msg"
    spooled.write_bytes(b"update")
    statefiles.move_into(spooled, tmp_path / "state" / "updates" / "c1.msg", sync=False)
    assert synced == []
    assert target.read_bytes() == b"new" and not temps(tmp_path)
    assert torch.equal(load_state(tmp_path / "state" / "w.safetensors")[0]["w"], torch.ones(3))
    statefiles.atomic_write(target, b"again")
    assert len(synced) == 2  # the file, then its folder


def test_a_discarded_file_or_folder_is_gone_at_once_and_deleted_soon(tmp_path: Path) -> None:
    folder, file, trash = tmp_path / "r1", tmp_path / "ck.safetensors", tmp_path / ".trash"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "c0.msg").write_bytes(b"x" * 1000)
    file.write_bytes(b"y")
    statefiles.discard(folder, trash)
    statefiles.discard(file, trash)
    statefiles.discard(tmp_path / "never-there", trash)  # nothing to do
    assert not folder.exists() and not file.exists()
    statefiles.wait_discarded(10)
    assert list(trash.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".trash"]


def test_the_thread_that_deletes_discarded_files_ends_when_they_are_deleted(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(b"z" * 10)
        statefiles.discard(tmp_path / f"f{i}", tmp_path / ".trash")
    statefiles.wait_discarded(10)
    assert list((tmp_path / ".trash").iterdir()) == []
    assert not any(t.name == "discard" for t in threading.enumerate())


def test_a_discard_whose_trash_cannot_be_made_deletes_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "updates" / "r3"
    folder.mkdir(parents=True)
    (folder / "c0.msg").write_bytes(b"x")
    real_mkdir = Path.mkdir

    def full(self: Path, *args: object, **kwargs: object) -> None:
        if self.name == ".trash":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", full)
    statefiles.discard(folder, tmp_path / ".trash")
    assert not folder.exists() and not (tmp_path / ".trash").exists()


def test_a_move_whose_folder_cannot_be_synced_leaves_the_file_where_it_was_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dest = tmp_path / "spool" / "a.msg", tmp_path / "updates" / "r1" / "c0.msg"
    src.parent.mkdir()
    src.write_bytes(b"update")
    real_fsync_dir = statefiles.fsync_dir
    failures = [OSError(errno.EIO, "Input/output error")]

    def fsync_dir(path: Path) -> None:
        if failures:
            raise failures.pop()
        real_fsync_dir(path)

    monkeypatch.setattr(statefiles, "fsync_dir", fsync_dir)
    with pytest.raises(StateUnwritable):
        statefiles.move_into(src, dest)
    assert src.read_bytes() == b"update"  # a retry finds it where it was
    assert dest.read_bytes() == b"update"  # and stored: never gone from both places
