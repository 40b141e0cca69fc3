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
        <digest>.msg                       a model one of them fetched in chunks, hard-linked there
                                           (copied across file systems), read-only; the newest KEEP
        locks/<digest[:2]>                 flock'ed by the learner fetching or linking a model: the
                                           others wait for it, then link its file into their own
                                           folder (a link: the file outlives its pruning)
        learners/models-<random>/          each learner's own folder, as above, there instead of
                                           under its state_dir (so that a share is a link)

A model read from the shared folder is used only if it is a regular file within the message
limit that decodes as a ModelReply of that digest whose tensors hash to it (codec.state_digest);
anything else is removed and fetched instead. The learners sharing a folder are one trust domain:
each can write the others' model files, as any of them could write its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
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

    def __init__(self, root: Path, wait_s: float, max_bytes: int) -> None:
        self.root = root
        self.wait_s = wait_s  # how long a learner waits for another fetching the same model
        self.max_bytes = max_bytes  # the largest file taken (FEDMQ_MAX_MESSAGE_BYTES)
        self.small: set[str] = set()  # jobs whose models came whole (not in chunks): nothing to share

    def check(self) -> None:
        """The folder made if need be; ConfigError (at the learner's start) if it cannot be written."""
        try:
            (self.root / "locks").mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{uuid.uuid4().hex}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise ConfigError(f"FEDMQ_SHARED_MODELS_DIR={self.root}: this learner cannot write there "
                              f"({why}); give the learners' user that folder, or unset it") from None

    @staticmethod
    def shares(digest: str) -> bool:
        """Whether `digest` (from a task: untrusted) may name a file in the folder."""
        return DIGEST.fullmatch(digest) is not None

    @contextlib.contextmanager
    def turn(self, digest: str) -> Iterator[None]:
        """While inside, no other learner of the host fetches or reads `digest` through the folder:
        they wait (at most `wait_s`, then go on without it: a stuck neighbour never stops one; nor
        does a folder it cannot lock in)."""
        try:  # a fixed set of locks, never removed: two models may share one (and wait for each other)
            lock = open(self.root / "locks" / digest[:2], "ab")  # noqa: SIM115 - closed below
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

    def take(self, digest: str, into: Path) -> tuple[Path, tuple[int, ...]] | None:
        """`digest`'s shared file as a new file of `into` (this learner's own folder), and the shared
        file's identity (for `discard`); None if the folder has none. A name that is not a regular
        file within the message limit (a link, a FIFO, a device) is refused as a bad model is."""
        shared = self.root / f"{digest}.msg"
        try:
            before = _regular(shared, self.max_bytes)
        except FileNotFoundError:
            return None
        except ValueError:  # never a model: gone (in this digest's turn, no learner is sharing it now)
            with contextlib.suppress(OSError):  # a folder stays: refused each time
                shared.unlink()
            raise
        own = into / f"{uuid.uuid4().hex}.msg"
        try:
            if _link_or_copy(shared, own, before) and _identity(own.lstat()) != before:
                raise ValueError(f"{shared} changed while it was linked")  # (a link links a symlink itself)
        except BaseException:
            own.unlink(missing_ok=True)
            raise
        return own, before

    def put(self, digest: str, path: Path) -> None:
        """Share this learner's fetched file of `digest` (read-only from now on), then keep only
        the newest KEEP."""
        path.chmod(0o444)
        temp = self.root / f".{digest}.{uuid.uuid4().hex}.tmp"
        try:
            if not _link_or_copy(path, temp):
                temp.chmod(0o444)
            os.replace(temp, self.root / f"{digest}.msg")
        finally:
            temp.unlink(missing_ok=True)
        self._prune()

    def discard(self, digest: str, refused: tuple[int, ...]) -> None:
        """The shared file of `digest`, found not to be what it claims (`refused`: its identity, as
        `take` gave it), removed so that it is fetched again; unless another learner has replaced it
        meanwhile."""
        shared = self.root / f"{digest}.msg"
        with contextlib.suppress(OSError):
            if _identity(shared.lstat()) == refused:
                shared.unlink()

    def _prune(self) -> None:
        models = []
        for path in self.root.glob("*.msg"):
            with contextlib.suppress(OSError):
                models.append((path.lstat().st_mtime, path))
        for _, path in sorted(models, reverse=True)[self.KEEP:]:
            path.unlink(missing_ok=True)  # a learner reading it holds its own link
        for temp in self.root.glob(".*.tmp"):  # a learner died between its link and rename
            with contextlib.suppress(OSError):
                if time.time() - temp.stat().st_ctime > ORPHAN_AGE_S:  # ctime: when it was linked
                    temp.unlink()


def _regular(path: Path, max_bytes: int) -> tuple[int, ...]:
    """The identity of `path`, a regular file (not followed if a link) of at most `max_bytes`;
    ValueError otherwise, FileNotFoundError if there is none."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if st.st_size > max_bytes:
        raise ValueError(f"{path} holds {st.st_size} bytes, over the {max_bytes} limit")
    return _identity(st)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What a file is, whatever its names (a hard link shares it): its device and inode, and its
    size and mtime, since a freed inode's number may come back at once for another file."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _link_or_copy(source: Path, dest: Path, expected: tuple[int, ...] | None = None) -> bool:
    """`dest` the same file as `source` (a hard link: True), or a copy of it on another file system
    (False); with `expected`, only a copy of the regular file of that identity (never through a
    link, never blocking on a FIFO)."""
    try:
        os.link(source, dest)
        return True
    except FileNotFoundError:
        raise
    except OSError:  # another file system, or links refused: a copy
        pass
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with open(fd, "rb") as src:
        if expected is not None and _identity(os.fstat(fd)) != expected:
            raise ValueError(f"{source} changed while it was copied")
        with open(dest, "xb") as out:
            shutil.copyfileobj(src, out)
    return False
