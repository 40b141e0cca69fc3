"""`make test`'s helper scripts say what they install or start, and why, before they do it;
FEDMQ_NO_INSTALL=1 makes them change nothing and only say what is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fedmq.services.cli.app import unknown_settings

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def fake_system(tmp_path: Path, **commands: str) -> tuple[dict[str, str], Path]:
    """A PATH with bash's basics and the given fake commands, each logging its call to `calls`."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for tool in ("bash", "grep", "seq", "sleep"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    for name, body in commands.items():
        path = bin_dir / name
        path.write_text(f"#!{shutil.which('bash')}\necho \"{name} $*\" >> {calls}\n{body}\n")
        path.chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return env, calls


def run(script: str, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPTS / script)], env={**env, **extra}, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(os.name != "posix", reason="shell scripts")
def test_ensure_tools_says_what_it_installs_and_why_before_apt_get(tmp_path: Path) -> None:
    env, calls = fake_system(tmp_path, id="echo 0", **{"apt-get": "exit 0"})
    done = run("ensure-tools.sh", env)
    assert done.returncode == 0
    said = done.stderr.splitlines()[0]
    assert said.startswith("ensure-tools: installing prometheus docker-compose chromium as root with apt-get "
                           "(FEDMQ_NO_INSTALL=1 to skip): the deployment tests use promtool")
    assert [line.split()[0] for line in calls.read_text().splitlines() if line.startswith("apt-get")] == [
        "apt-get", "apt-get"]  # update, then install


@pytest.mark.skipif(os.name != "posix", reason="shell scripts")
def test_with_fedmq_no_install_ensure_tools_only_says_what_is_missing(tmp_path: Path) -> None:
    env, calls = fake_system(tmp_path, id="echo 0", **{"apt-get": "exit 0"})
    done = run("ensure-tools.sh", env, FEDMQ_NO_INSTALL="1")
    assert done.returncode == 0
    assert done.stderr.startswith("ensure-tools: missing prometheus docker-compose chromium; not installing "
                                  "them (FEDMQ_NO_INSTALL=1)")
    assert not calls.exists() or "apt-get" not in calls.read_text()


@pytest.mark.skipif(os.name != "posix", reason="shell scripts")
def test_ensure_rabbitmq_says_it_starts_the_broker_and_with_fedmq_no_install_does_not(tmp_path: Path) -> None:
    up = f"grep -q '^rabbitmq-server' {tmp_path / 'calls'}"  # the broker answers once it was started
    env, calls = fake_system(tmp_path, **{"rabbitmq-server": "exit 0", "rabbitmq-diagnostics": up})
    done = run("ensure-rabbitmq.sh", env, FEDMQ_NO_INSTALL="1")
    assert done.returncode == 0
    assert "not running; not starting it (FEDMQ_NO_INSTALL=1)" in done.stderr
    assert "rabbitmq-server" not in calls.read_text()  # only the ping was run
    started = run("ensure-rabbitmq.sh", env)
    assert started.stderr.startswith("ensure-rabbitmq: starting the local broker, for the RabbitMQ tests")
    assert "rabbitmq-server -detached" in calls.read_text() and "broker is up" in started.stderr


def test_fedmq_no_install_is_no_typo_to_the_cli() -> None:
    assert unknown_settings({"FEDMQ_NO_INSTALL": "1", "FEDMQ_NO_INSTAL": "1"}) == [
        "FEDMQ_NO_INSTAL is not a fedmq setting: did you mean FEDMQ_NO_INSTALL?"]
