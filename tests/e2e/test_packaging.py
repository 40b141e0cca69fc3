"""The wheel a user installs: one top-level name, importable from anywhere, no clash with theirs.

The wheel is built offline from a copy of the checkout and installed with --no-deps into a fresh
virtualenv, which sees this environment's third-party packages (torch, pika, ...) through a .pth
line. Such a line only puts a directory on sys.path; it does not run the .pth files inside it,
so the editable install of fedmq there stays switched off, and only the wheel's fedmq exists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import fedmq
from tests.conftest import REPO

PY = sys.executable
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".fedmq", "runs"
)


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the venv's own paths
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # From a copy, so that the build leaves nothing (build/, *.egg-info) in the checkout.
    source = tmp_path_factory.mktemp("source") / "fedmq"
    shutil.copytree(REPO, source, symlinks=True, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    built = run(PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", source,
                "-w", out, cwd=out)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("fedmq-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv") / "venv"
    made = run(PY, "-m", "venv", "--without-pip", root, cwd=root.parent)
    assert made.returncode == 0, made.stderr
    python = root / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root)
    project_packages = sysconfig.get_paths()["purelib"]
    (Path(purelib.stdout.strip()) / "project-packages.pth").write_text(project_packages + "\n")
    installed = run(PY, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel,
                    cwd=root)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return root


def test_the_wheel_holds_only_fedmq_and_its_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/")[0] for name in archive.namelist()}
    assert top == {"fedmq", f"fedmq-{fedmq.__version__}.dist-info"}


PROBE = """
import importlib, importlib.resources, json
out = {}
for name in ("common", "services"):
    try:
        importlib.import_module(name)
        out[name] = "imported"
    except ModuleNotFoundError:
        out[name] = "not found"
import fedmq.common.codec
out["codec"] = fedmq.common.codec.__file__
out["py.typed"] = str(importlib.resources.files("fedmq") / "py.typed")
print(json.dumps(out))
"""


def test_the_installed_wheel_imports_as_fedmq_only_from_anywhere(venv: Path, tmp_path: Path) -> None:
    probe = run(venv / "bin" / "python", "-c", PROBE, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert found["common"] == found["services"] == "not found"
    assert Path(found["codec"]).resolve().is_relative_to(venv.resolve())
    assert Path(found["py.typed"]).is_file()
    assert Path(found["py.typed"]).resolve().is_relative_to(venv.resolve())
    version = run(venv / "bin" / "fedmq", "--version", cwd=tmp_path, timeout=120)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"fedmq {fedmq.__version__}"


USERS_TASK = '''
from torch import nn

from fedmq.tasks.digits import Digits


class Wide(Digits):
    """The user's own Task: digits with a wider network of their own."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
'''

USERS_JOB = """\
name: users-common
seed: 1
task: {name: "common.tasks:Wide", options: {partition: {kind: iid}}}
clients: {total: 2}
rounds: 2
train: {epochs: 1, batch_size: 64, lr: 0.1}
"""


def test_a_users_own_package_named_common_holds_the_task(venv: Path, tmp_path: Path) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "__init__.py").write_text("")
    (tmp_path / "common" / "tasks.py").write_text(USERS_TASK)
    (tmp_path / "job.yaml").write_text(USERS_JOB)
    state = tmp_path / "state"
    done = run(venv / "bin" / "fedmq", "run", "job.yaml", "--json", "--state-dir", state, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "completed"
    assert [h["round"] for h in result["history"]] == [0, 1, 2]
    assert Path(result["model_path"]).is_relative_to(state)
