"""Where a learner keeps the global models it fetched as files, read one tensor at a time.

    <state_dir>/learner/models-<random>/   one folder per learner process, made on its first fetch
        lock                               flock'ed by that process while it runs (made and locked
                                           as making-<random>, then renamed)
        <uuid>.msg                         a ModelReply as it came off the bus, chunk by chunk; its
                                           tensors are read from it on access (codec.TensorFile)

A large model is never held whole in memory twice: its chunks go to the file as they arrive, the
model loads from it, and the copy kept for the round's next client (and for FedProx's anchor or a
compressed update's delta) is the file, not tensors. The work cache deletes a model's file when it
drops the model; `close` removes the folder. A folder whose lock any process can take belongs to a
learner that died (SIGKILL): the next learner to start here removes it.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

ORPHAN_AGE_S = 60.0  # a folder with no lock file is another learner's being made, unless older


class ModelFolder:
    """This learner's folder of fetched models under `root`; made on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._path: Path | None = None
        self._lock: IO[bytes] | None = None
        self._guard = threading.Lock()

    @property
    def path(self) -> Path:
        """The folder, made (and the dead learners' swept) the first time it is asked for."""
        with self._guard:
            if self._path is None:
                self.root.mkdir(parents=True, exist_ok=True)
                sweep(self.root)
                # Made and locked under a name no sweep looks at, then renamed: a learner starting
                # at the same moment never sees it unlocked.
                making = Path(tempfile.mkdtemp(prefix="making-", dir=self.root))
                lock: IO[bytes] | None = None
                try:
                    lock = open(making / "lock", "wb")  # noqa: SIM115 - held for the process's life
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    path = self.root / f"models-{making.name.removeprefix('making-')}"
                    making.rename(path)
                except BaseException:
                    if lock is not None:
                        lock.close()
                    shutil.rmtree(making, ignore_errors=True)
                    raise
                self._path, self._lock = path, lock
            return self._path

    def close(self) -> None:
        """Remove the folder and every model in it."""
        with self._guard:
            if self._path is not None:
                shutil.rmtree(self._path, ignore_errors=True)
            if self._lock is not None:
                self._lock.close()
            self._path, self._lock = None, None


def sweep(root: Path) -> list[Path]:
    """Remove the model folders under `root` whose learner is gone (and folders a learner died
    making, once ORPHAN_AGE_S old); the folders removed."""
    removed = []
    for folder in [*root.glob("models-*"), *root.glob("making-*")]:
        if _in_use(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _in_use(folder: Path) -> bool:
    if folder.name.startswith("making-"):  # its lock may be taken this instant: judged by age alone
        return _young(folder)
    try:
        with open(folder / "lock", "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False  # nobody holds it: its learner is gone
    except BlockingIOError:
        return True
    except FileNotFoundError:
        return _young(folder)
    except OSError:
        return True


def _young(folder: Path) -> bool:
    """Made less than ORPHAN_AGE_S ago (or gone already: nothing to remove)."""
    try:
        return time.time() - folder.stat().st_mtime < ORPHAN_AGE_S
    except OSError:
        return True
