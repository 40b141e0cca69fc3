"""Where a learner keeps the global models it fetched as files, read one tensor at a time, and
the folder the learners of one host share them through (FEDMQ_SHARED_MODELS_DIR).

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

    <FEDMQ_SHARED_MODELS_DIR>/             one folder for the learners of a host (SharedModels)
        <digest>.msg                       a model one of them fetched, hard-linked there (copied
                                           across file systems); the newest KEEP stay
        <digest>.lock                      flock'ed by the learner fetching or reading that model:
                                           the others wait for it, then link its file into their
                                           own folder (a link: the file outlives its pruning)

A model read from the shared folder is used only if it decodes as a ModelReply of that digest
and its tensors hash to it (codec.state_digest); anything else is removed and fetched instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import structlog

from fedmq.common.errors import ConfigError

log = structlog.get_logger("fedmq.learner")

ORPHAN_AGE_S = 60.0  # a folder with no lock file is another learner's being made, unless older
DIGEST = re.compile(r"[0-9a-f]{64}")  # a model digest (state_digest): the only names the shared folder takes


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


class SharedModels:
    """The folder through which the learners of one host share the global models they fetch."""

    KEEP = 4  # models kept in the folder: a round's, and a few jobs' at once

    def __init__(self, root: Path, wait_s: float) -> None:
        self.root = root
        self.wait_s = wait_s  # how long a learner waits for another fetching the same model

    @classmethod
    def opened(cls, root: Path, wait_s: float) -> SharedModels:
        """The folder, made if need be; ConfigError (at the learner's start) if this learner cannot
        write there."""
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / f".probe-{uuid.uuid4().hex}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise ConfigError(f"FEDMQ_SHARED_MODELS_DIR={root}: this learner cannot write there ({why}); "
                              "give the learners' user that folder, or unset it") from None
        return cls(root, wait_s)

    @staticmethod
    def shares(digest: str) -> bool:
        """Whether `digest` (from a task: untrusted) may name a file in the folder."""
        return DIGEST.fullmatch(digest) is not None

    @contextlib.contextmanager
    def turn(self, digest: str) -> Iterator[None]:
        """While inside, no other learner of the host fetches or reads `digest` through the folder:
        they wait (at most `wait_s`, then go on without it: a stuck neighbour never stops one; nor
        does a folder it cannot lock in)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / f"{digest}.lock", "ab")  # noqa: SIM115 - closed below
        except OSError as exc:
            log.warning("shared_model_unlockable", error=str(exc)[:300])
            yield
            return
        with lock:
            deadline = time.monotonic() + self.wait_s
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("shared_model_wait_over", digest=digest[:12], waited_s=self.wait_s)
                        break
                    time.sleep(0.02)
            yield  # the lock goes with the file's close

    def take(self, digest: str, into: Path) -> Path | None:
        """`digest`'s shared file as a new file of `into` (this learner's own folder); None if the
        folder has none."""
        own = into / f"{uuid.uuid4().hex}.msg"
        try:
            _link_or_copy(self.root / f"{digest}.msg", own)
        except FileNotFoundError:
            return None
        return own

    def put(self, digest: str, path: Path) -> None:
        """Share this learner's fetched file of `digest`, then keep only the newest KEEP."""
        temp = self.root / f".{digest}.{uuid.uuid4().hex}.tmp"
        try:
            _link_or_copy(path, temp)
            os.replace(temp, self.root / f"{digest}.msg")
        finally:
            temp.unlink(missing_ok=True)
        self._prune()

    def discard(self, digest: str, refused: tuple[int, ...]) -> None:
        """The shared file of `digest`, found not to be what it claims (`refused`: its file_identity),
        removed so that it is fetched again; unless another learner has replaced it meanwhile."""
        shared = self.root / f"{digest}.msg"
        with contextlib.suppress(OSError):
            if file_identity(shared) == refused:
                shared.unlink()

    def _prune(self) -> None:
        models = []
        for path in self.root.glob("*.msg"):
            with contextlib.suppress(OSError):
                models.append((path.stat().st_mtime, path))
        for _, path in sorted(models, reverse=True)[self.KEEP:]:
            path.unlink(missing_ok=True)  # a learner reading it holds its own link
            path.with_suffix(".lock").unlink(missing_ok=True)
        for temp in self.root.glob(".*.tmp"):  # a learner died between its link and rename
            with contextlib.suppress(OSError):
                if time.time() - temp.stat().st_ctime > ORPHAN_AGE_S:  # ctime: when it was linked
                    temp.unlink()


def file_identity(path: Path) -> tuple[int, ...]:
    """What a file is, whatever its names (a hard link shares it): its device and inode, and its
    size and mtime, since a freed inode's number may come back at once for another file."""
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _link_or_copy(source: Path, dest: Path) -> None:
    """`dest` the same file as `source` (a hard link), or a copy of it on another file system."""
    try:
        os.link(source, dest)
    except FileNotFoundError:
        raise
    except OSError:  # another file system, or links refused: a copy
        shutil.copyfile(source, dest)
