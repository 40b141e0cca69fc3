"""Writing a service's state to disk: whole or not at all, durable once written, failures named.

    write ─▶ .<name>.<pid>.tmp ─▶ fsync ─▶ rename over <name> ─▶ fsync the folder
              ✗ anywhere: the temp file is removed, the old <name> is untouched,
                          and StateUnwritable names the path and errno
    stage many ─▶ their temp files ─▶ commit: fsync each, rename each, fsync each folder once

Readers only ever open final names, so a half-written file (a crash mid-write, a full disk)
is never picked up; `remove_temps` sweeps what a crash left. With `sync=False` (FEDMQ_FSYNC=false,
as `fedmq run` sets it) the two fsyncs are skipped: a killed process still leaves whole files (the
rename is atomic and the kernel keeps what was written), only a power loss may not.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from fedmq.common.errors import StateUnwritable

# A job id that may name a folder (the aggregator's store, a learner's DDP rank): never a path out.
JOB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,127}")

TEMP_SUFFIX = ".tmp"


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Any OSError inside becomes StateUnwritable naming `path` (its own filename if it has one)."""
    try:
        yield
    except OSError as exc:
        where = exc.filename if isinstance(exc.filename, str) else str(path)
        raise StateUnwritable(where, exc.errno, exc.strerror or str(exc)) from exc


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")


def atomic_write(path: Path, data: bytes, sync: bool = True) -> None:
    """Replace `path` with `data`, durably."""

    def produce(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                _flush(f)

    _replace(path, produce, sync)


def atomic_file(path: Path, produce: Callable[[Path], object], sync: bool = True) -> None:
    """Replace `path` with the file `produce(tmp)` writes at a temporary path (a library's writer)."""

    def synced(tmp: Path) -> None:
        produce(tmp)
        if sync:
            with open(tmp, "rb") as f:
                _flush(f)

    _replace(path, synced, sync)


def _replace(path: Path, produce: Callable[[Path], object], sync: bool) -> None:
    tmp = temp_path(path)
    with writing(path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            produce(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if sync:
            fsync_dir(path.parent)


def stage(path: Path, data: bytes) -> Path:
    """Write `data` to `path`'s temporary name, neither fsynced nor in place: `commit` makes it
    `path`, together with others (a group commit); the temporary file it returns is never read."""
    tmp = temp_path(path)
    with writing(path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return tmp


def commit(staged: list[tuple[Path, Path]], sync: bool = True) -> None:
    """Make each (temporary, final) pair of `stage` its final file, durably: every file fsynced,
    then renamed, then each folder fsynced once. A failure leaves the pairs not yet renamed as
    they were (the caller removes them) and raises StateUnwritable."""
    if sync:
        for tmp, final in staged:
            with writing(final), open(tmp, "rb") as f:
                os.fsync(f.fileno())
    for tmp, final in staged:
        with writing(final):
            os.replace(tmp, final)
    if sync:
        for folder in dict.fromkeys(final.parent for _, final in staged):
            with writing(folder):
                fsync_dir(folder)


def move_into(src: Path, dest: Path, sync: bool = True) -> None:
    """Move a file that is already durable (fsynced when written) to `dest`, durably. If the
    folder's fsync fails, the file is at `dest` and linked back at `src` too: a retry finds it
    where it was (a spooled update handled again: stored now, a duplicate)."""
    with writing(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dest)
        if sync:
            try:
                fsync_dir(dest.parent)
            except OSError:
                with contextlib.suppress(OSError):
                    os.link(dest, src)
                raise


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(path: Path, trash: Path) -> None:
    """Delete a file or folder soon, on a background thread: moved now into `trash` (a folder on
    the same disk, emptied when its owner starts), so it is gone from where it was at once.
    Freeing a large file's blocks takes tens of milliseconds (ext4, 200 MB): a round's close, which
    its learners wait for, need not. The thread ends once nothing is left to delete."""
    global _deleting
    gone = trash / uuid.uuid4().hex
    try:
        trash.mkdir(parents=True, exist_ok=True)
        os.replace(path, gone)
    except OSError:  # nothing there; or a full disk (the trash's folder): deleted now, as before
        _delete(path)
        return
    with _discard_lock:
        _discarded.append(gone)
        if _deleting is None:
            _deleting = threading.Thread(target=_delete_discarded, name="discard", daemon=True)
            try:
                _deleting.start()
            except RuntimeError:  # no thread to be had: deleted now, as before
                _deleting = None
                _discarded.remove(gone)
                _delete(gone)


def wait_discarded(timeout: float | None = None) -> None:
    """Until what was discarded so far is deleted: a stop leaves no thread of its own behind."""
    with _discard_lock:
        thread = _deleting
    if thread is not None:
        thread.join(timeout)


_discard_lock = threading.Lock()
_discarded: list[Path] = []  # moved into a trash, not deleted yet
_deleting: threading.Thread | None = None  # the thread deleting them, while there are any


def _delete_discarded() -> None:
    global _deleting
    while True:
        with _discard_lock:
            if not _discarded:
                _deleting = None
                return
            path = _discarded.pop(0)
        _delete(path)


def _delete(path: Path) -> None:
    """Delete a file or folder, whatever is left: the owner's start empties its trash again."""
    if os.path.isdir(path):  # never raises
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def remove_temps(root: Path) -> int:
    """Delete temporary files a crash left under `root`; how many there were."""
    if not root.is_dir():
        return 0
    stale = [p for p in root.rglob(f".*{TEMP_SUFFIX}") if p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def _flush(f: BinaryIO) -> None:
    """Data on disk before the rename that makes it the state (ENOSPC may only show here)."""
    f.flush()
    os.fsync(f.fileno())
