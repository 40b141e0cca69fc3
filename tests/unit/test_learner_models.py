"""A learner's folder of fetched models: made on first use, removed on close, swept when its learner
died; and the folder the learners of one host share them through."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedmq.services.learner import models as models_module
from fedmq.services.learner.models import ORPHAN_AGE_S, ModelFolder, SharedModels, sweep

DIGESTS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(8)]


def test_the_folder_is_made_on_first_use_and_removed_on_close(tmp_path: Path) -> None:
    models = ModelFolder(tmp_path / "learner")
    assert not (tmp_path / "learner").exists(), "nothing made before a large model comes"
    folder = models.path
    assert folder.is_dir() and folder.parent == tmp_path / "learner" and models.path == folder
    (folder / "a.msg").write_bytes(b"x")
    models.close()
    assert not folder.exists()


def test_a_running_learners_folder_is_kept_and_a_dead_ones_swept(tmp_path: Path) -> None:
    root = tmp_path / "learner"
    alive = ModelFolder(root)
    mine = alive.path
    # Another process makes its folder and dies without closing it (SIGKILL): its lock is free.
    code = ("import sys; from pathlib import Path; from fedmq.services.learner.models import ModelFolder; "
            "f = ModelFolder(Path(sys.argv[1])); (f.path / 'model.msg').write_bytes(b'x'); print(f.path)")
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=True)
    dead = Path(out.stdout.strip())
    assert dead.is_dir() and dead != mine
    being_made = root / "models-new"  # no lock yet: a learner starting right now
    being_made.mkdir()
    old = root / "models-old"  # no lock, and old: never finished
    old.mkdir()
    past = time.time() - 2 * ORPHAN_AGE_S
    os.utime(old, (past, past))
    assert sorted(sweep(root)) == sorted([dead, old])
    assert mine.is_dir() and being_made.is_dir()
    alive.close()


def test_learners_starting_together_never_sweep_each_others_folders(tmp_path: Path) -> None:
    """Each learner's first fetch sweeps the others' folders while they may be making theirs."""
    import threading

    root = tmp_path / "learner"
    for _ in range(20):
        folders = [ModelFolder(root) for _ in range(8)]
        start = threading.Barrier(len(folders))
        made: list[Path] = []

        def first_fetch(folder: ModelFolder, start: threading.Barrier, made: list[Path]) -> None:
            start.wait()
            made.append(folder.path)

        threads = [threading.Thread(target=first_fetch, args=(f, start, made)) for f in folders]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(set(made)) == len(folders) and all(path.is_dir() for path in made)
        for folder in folders:
            folder.close()


def test_only_a_digest_names_a_shared_file() -> None:
    assert SharedModels.shares(DIGESTS[1])
    for name in ("../" + DIGESTS[1][3:], DIGESTS[1].upper(), DIGESTS[1][:-1], "", "a" * 65, "x/" + "a" * 62):
        assert not SharedModels.shares(name), name


def test_a_shared_model_is_linked_into_each_readers_folder_and_outlives_its_pruning(tmp_path: Path) -> None:
    shared = SharedModels(tmp_path / "shared", wait_s=1.0, max_bytes=1 << 20)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    for folder in (mine, theirs):
        folder.mkdir()
    shared.check()
    assert shared.take(DIGESTS[0], theirs) is None, "nothing shared yet"
    fetched = mine / "fetched.msg"
    fetched.write_bytes(b"model 0")
    shared.put(DIGESTS[0], fetched)
    taken = shared.take(DIGESTS[0], theirs)
    assert taken is not None
    own, identity = taken
    assert own.parent == theirs and own.read_bytes() == b"model 0"
    assert not os.access(own, os.W_OK) or os.geteuid() == 0, "read-only once shared"
    assert oct(own.stat().st_mode & 0o777) == oct(0o444)
    assert os.path.samefile(own, shared.root / f"{DIGESTS[0]}.msg"), "a hard link, not a copy"
    for i, digest in enumerate(DIGESTS[1:], 1):  # newer models push it out of the folder
        other = mine / f"{i}.msg"
        other.write_bytes(f"model {i}".encode())
        os.utime(other, (time.time() + i, time.time() + i))
        shared.put(digest, other)
    kept = sorted(p.stem for p in shared.root.glob("*.msg"))
    assert kept == sorted(DIGESTS[-SharedModels.KEEP:]), "the newest KEEP stay"
    assert own.read_bytes() == b"model 0", "a reader's link outlives the shared file"


def test_a_share_across_file_systems_is_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def cross_device(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(models_module.os, "link", cross_device)
    shared = SharedModels(tmp_path / "shared", wait_s=1.0, max_bytes=1 << 20)
    shared.check()
    fetched = tmp_path / "fetched.msg"
    fetched.write_bytes(b"model")
    shared.put(DIGESTS[0], fetched)
    taken = shared.take(DIGESTS[0], tmp_path)
    assert taken is not None and taken[0].read_bytes() == b"model"
    assert not os.path.samefile(taken[0], fetched)


def test_one_learner_at_a_time_takes_its_turn_with_a_model_and_a_stuck_one_is_waited_for_only_so_long(
    tmp_path: Path,
) -> None:
    shared = SharedModels(tmp_path / "shared", wait_s=0.3, max_bytes=1 << 20)
    shared.check()
    inside: list[str] = []
    entered = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with shared.turn(DIGESTS[0]):
            inside.append("holder")
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=holder)
    thread.start()
    assert entered.wait(5)
    started = time.monotonic()
    with shared.turn(DIGESTS[0]):  # the holder never lets go in time: this one goes on without it
        inside.append("waiter")
    assert time.monotonic() - started >= 0.3
    with shared.turn(DIGESTS[1]):  # another model's turn is its own
        inside.append("other")
    release.set()
    thread.join(5)
    with shared.turn(DIGESTS[0]):  # let go: taken at once
        inside.append("after")
    assert inside == ["holder", "waiter", "other", "after"]


def test_a_shared_folder_the_learner_cannot_write_is_refused_at_its_start(tmp_path: Path) -> None:
    from fedmq.common.errors import ConfigError

    blocked = tmp_path / "file"
    blocked.write_bytes(b"not a folder")
    with pytest.raises(ConfigError, match="FEDMQ_SHARED_MODELS_DIR=.*cannot write there.*unset it"):
        SharedModels(blocked / "models", wait_s=1.0, max_bytes=1 << 20).check()
    made = SharedModels(tmp_path / "made" / "here", wait_s=1.0, max_bytes=1 << 20)
    assert not made.root.exists(), "nothing made before the learner starts"
    made.check()
    assert made.root.is_dir()


@pytest.mark.parametrize("planted", ["symlink", "fifo", "device", "oversized", "folder"])
def test_a_shared_name_that_is_not_a_model_file_is_refused_and_removed_without_blocking(
    tmp_path: Path, planted: str
) -> None:
    shared = SharedModels(tmp_path / "shared", wait_s=1.0, max_bytes=1024)
    shared.check()
    own = tmp_path / "own"
    own.mkdir()
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 10)
    name = shared.root / f"{DIGESTS[0]}.msg"
    if planted == "symlink":
        name.symlink_to(target)
    elif planted == "fifo":
        os.mkfifo(name)
    elif planted == "device":
        name.symlink_to("/dev/zero")
    elif planted == "oversized":
        name.write_bytes(b"x" * 2048)
    else:
        name.mkdir()
    with pytest.raises(ValueError, match="not a regular file|over the 1024 limit"):
        shared.take(DIGESTS[0], own)
    assert list(own.iterdir()) == [], "nothing linked or copied"
    if planted != "folder":
        assert not name.is_symlink() and not name.exists(), "the bad name is gone"
    assert target.read_bytes() == b"x" * 10
