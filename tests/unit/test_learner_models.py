"""A learner's folder of fetched models: made on first use, removed on close, swept when its learner died."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from fedmq.services.learner.models import ORPHAN_AGE_S, ModelFolder, sweep


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
