"""The repository's compose.yaml, run by the compose-local tool (local images, no registry), for a test.

    up.sh        build the images as needed, `docker compose up -d --build --wait`, N learners
    compose(...) any `docker compose` command, with the tool's override file laid over compose.yaml
    down.sh      `down -v`: containers, network and volumes (images stay cached)

The tool lives outside the repository: FEDMQ_COMPOSE_LOCAL, else ../shared/tools/compose-local.
Its ports are on 127.0.0.1: AMQP on LOCAL_AMQP_PORT (35672), Prometheus on LOCAL_PROMETHEUS_PORT (39090).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import REPO

TOOL = Path(os.environ.get("FEDMQ_COMPOSE_LOCAL") or REPO.parent / "shared" / "tools" / "compose-local")
AMQP_PORT = int(os.environ.get("LOCAL_AMQP_PORT", "35672"))
PROMETHEUS = f"http://127.0.0.1:{os.environ.get('LOCAL_PROMETHEUS_PORT', '39090')}"
CONSOLE_PORT = int(os.environ.get("LOCAL_CONSOLE_PORT", "38080"))
CONSOLE = f"http://127.0.0.1:{CONSOLE_PORT}"
ENV_FILE = REPO / ".env"
ENV_EXAMPLE = REPO / "deploy" / "compose.env.example"


def unavailable() -> str | None:
    """Why the stack cannot run here (no tool, no Docker engine), or None."""
    if not (TOOL / "up.sh").is_file():
        return f"the compose-local tool is not at {TOOL} (set FEDMQ_COMPOSE_LOCAL to its folder)"
    if shutil.which("docker") is None:
        return "no Docker engine: the docker command is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode == 0:
        return None
    if os.geteuid() == 0 and (shutil.which("dockerd") or shutil.which("apt-get")):
        return None  # up.sh installs docker.io from apt when missing, and starts dockerd
    said = (info.stderr.strip().splitlines() or ["?"])[-1]
    return f"no Docker engine: `docker info` says: {said}"


@contextmanager
def env_file() -> Iterator[dict[str, str]]:
    """The passwords compose.yaml reads from .env: the example's, unless an .env is there already.

    An .env this made is removed afterwards; one that was there is left as it was.
    """
    made = not ENV_FILE.exists()
    if made:
        shutil.copyfile(ENV_EXAMPLE, ENV_FILE)
    try:
        pairs = (line.split("=", 1) for line in ENV_FILE.read_text().splitlines() if "=" in line)
        yield {k.strip(): v.strip() for k, v in pairs if not k.lstrip().startswith("#")}
    finally:
        if made:
            ENV_FILE.unlink(missing_ok=True)


@dataclass
class Stack:
    """One compose project: the repository's compose.yaml with the tool's override."""

    learners: int
    log: Path  # the tool's and compose's output, appended
    console_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # for --profile console

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "FEDMQ_PROJECT": str(REPO), "LEARNERS": str(self.learners),
                "COMPOSE_LOCAL_DIR": str(TOOL), "COMPOSE_BAKE": "false",
                "CONSOLE_TOKEN": self.console_token, "CONSOLE_PORT": str(CONSOLE_PORT)}

    def command(self, *args: str) -> list[str]:
        """A `docker compose` command line for this project (as the tool's env.sh builds it)."""
        return ["docker", "compose", "--project-directory", str(REPO), "-f", str(REPO / "compose.yaml"),
                "-f", str(TOOL / "compose.local.yaml"), *args]

    def _run(self, argv: list[str], timeout: float) -> str:
        """Run a command with its output in the log; its stdout, or AssertionError with the tail."""
        with self.log.open("a") as log:
            log.write(f"\n$ {' '.join(argv)}\n")
        proc = subprocess.run(argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
        with self.log.open("a") as log:
            log.write(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        return proc.stdout

    def compose(self, *args: str, timeout: float = 120) -> str:
        return self._run(self.command(*args), timeout)

    def up(self) -> None:
        """Build what is missing and start everything, healthy, with `learners` learners."""
        self._run([str(TOOL / "up.sh")], timeout=1200)

    def down(self, volumes: bool) -> None:
        """Stop and remove the containers; with `volumes`, the jobs and the broker's data too."""
        if volumes:
            self._run([str(TOOL / "down.sh")], timeout=300)
        else:
            self.compose("--profile", "tools", "--profile", "console", "down", "--remove-orphans",
                         timeout=300)

    def docker(self, *args: str, timeout: float = 60) -> str:
        return self._run(["docker", *args], timeout)

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service)


def prometheus(path: str, **params: str | float) -> Any:
    """GET a Prometheus HTTP API path; its `data`."""
    url = f"{PROMETHEUS}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]


def console(path: str, token: str | None) -> tuple[int, str, bytes, dict[str, str]]:
    """GET a console path (with the bearer token, or none), no redirect followed: status, where a
    redirect points, the body and the headers."""

    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    request = urllib.request.Request(f"{CONSOLE}{path}", headers={"accept": "text/html"})
    if token is not None:
        request.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.build_opener(Stay).open(request, timeout=30) as reply:
            return reply.status, "", reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("location", ""), exc.read(), dict(exc.headers)
