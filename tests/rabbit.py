"""RabbitMQ for tests: a fresh vhost per test, a loud skip without a broker, a failure under CI.

Every test that gets here must carry the `rabbitmq` marker (tests/tiers.py adds it), so that
`pytest -m "not rabbitmq"` is exactly the broker-free tier; one that does not fails, broker or not.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.settings import Settings
from tests.ci import under_ci

BASE_URL = os.environ.get("FEDMQ_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/")


def _unavailable() -> str | None:
    parts = urlsplit(BASE_URL)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=2):
            pass
    except OSError as exc:
        where = f"{parts.hostname}:{parts.port or 5672}"
        return f"no RabbitMQ at {where} ({exc}); start it with `rabbitmq-server -detached`"
    if shutil.which("rabbitmqctl") is None:
        return "rabbitmqctl is not on PATH: it is needed to give each test its own vhost"
    return None


# The test pytest is running now, set by tests/conftest.py; empty outside pytest (benchmarks).
RUNNING: list[pytest.Item] = []


def require_rabbitmq() -> None:
    """Return if a broker answers; else skip loudly, or fail under CI."""
    if RUNNING and RUNNING[0].get_closest_marker("rabbitmq") is None:
        pytest.fail(f"{RUNNING[0].nodeid} uses RabbitMQ but is not marked `rabbitmq`: "
                    "mark it with @pytest.mark.rabbitmq (tests/tiers.py)")
    reason = _unavailable()
    if reason is None:
        return
    if under_ci():
        pytest.fail(f"RabbitMQ is required under CI: {reason}")
    pytest.skip(f"SKIPPING RabbitMQ TEST: {reason}")


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


class _Vhosts:
    """New vhosts made, and used ones deleted, VHOST_BATCH at a time in one `rabbitmqctl eval`.

    Each rabbitmqctl call boots an Erlang VM (about a CPU-second here); three per test's vhost
    were a sixth of the suite's CPU. A vhost is still never reused: each test gets a new one,
    and the used ones go with the next batch, or when the process exits."""

    def __init__(self) -> None:
        self.ready: list[str] = []
        self.used: list[str] = []

    def take(self) -> str:
        if not self.ready:
            made = [f"fedmq-test-{uuid.uuid4().hex[:10]}" for _ in range(VHOST_BATCH)]
            self._eval(made, self.used)
            self.ready, self.used = made, []
        return self.ready.pop()

    def give_back(self, name: str) -> None:
        self.used.append(name)

    def close(self) -> None:
        if self.used or self.ready:
            self._eval([], self.used + self.ready)
            self.ready, self.used = [], []

    @staticmethod
    def _eval(add: list[str], delete: list[str]) -> None:
        user = urlsplit(BASE_URL).username or "guest"
        steps = [f'rabbit_vhost:delete(<<"{name}">>, <<"tests">>)' for name in delete]
        for name in add:
            steps += [f'ok = rabbit_vhost:add(<<"{name}">>, <<"tests">>)',
                      f'ok = rabbit_auth_backend_internal:set_permissions(<<"{user}">>, <<"{name}">>, '
                      '<<".*">>, <<".*">>, <<".*">>, <<"tests">>)']
        _ctl("eval", ", ".join([*steps, "ok"]) + ".")


VHOST_BATCH = 8
_VHOSTS = _Vhosts()
atexit.register(_VHOSTS.close)


@contextmanager
def fresh_vhost() -> Iterator[str]:
    """A new vhost with full rights for the test user; its URL. Deleted afterwards (see _Vhosts)."""
    require_rabbitmq()
    name = _VHOSTS.take()
    try:
        yield f"{BASE_URL.rstrip('/')}/{name}"
    finally:
        _VHOSTS.give_back(name)


def close_connections(url: str, reason: str = "test") -> None:
    """Close every client connection of the URL's vhost from the broker side (and no other's)."""
    _ctl("close_all_connections", "-p", urlsplit(url).path.lstrip("/"), reason)


def dead_letters(url: str) -> list[tuple[dict, bytes]]:
    """Drain fedmq.dead on a vhost: (headers, body) of every dead-lettered message."""
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        out: list[tuple[dict, bytes]] = []
        while True:
            method, props, body = ch.basic_get("fedmq.dead", auto_ack=True)
            if method is None:
                return out
            out.append((dict(props.headers or {}), body))
    finally:
        conn.close()


DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SERVICE_USERS = ("scheduler", "aggregator", "learner", "cli")
TOPOLOGY_KINDS = ("queues", "exchanges", "bindings")


@dataclass
class Deployed:
    """deploy/rabbitmq/definitions.json imported under unique names: a vhost and one user per service."""

    vhost: str
    names: dict[str, str]  # service user in the definitions → its name on this broker
    passwords: dict[str, str]
    where: str

    def url(self, user: str) -> str:
        return f"amqp://{self.names[user]}:{self.passwords[user]}@{self.where}/{self.vhost}"

    def role_env(self) -> dict[str, str]:
        """FEDMQ_<ROLE>_USERS naming this broker's users (common/senders.py), for every service."""
        return {f"FEDMQ_{role.upper()}_USERS": name for role, name in self.names.items()}


def _ctl_out(*args: str, stdin: str | None = None) -> str:
    command = ["rabbitmqctl", "-q", *args]
    proc = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"rabbitmqctl {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


@contextmanager
def deployed_vhost() -> Iterator[Deployed]:
    """The deployment's users, permissions and topology in a private vhost; all deleted afterwards.

    The passwords are the development ones of deploy/compose.env.example (the hashes in
    definitions.json are theirs); the administrator is not imported.
    """

    require_rabbitmq()
    suffix = uuid.uuid4().hex[:8]
    vhost = f"fedmq-deploy-{suffix}"
    defs = json.loads((DEPLOY / "rabbitmq" / "definitions.json").read_text())
    names = {u: f"{u}-{suffix}" for u in SERVICE_USERS}
    imported = {
        "users": [{**u, "name": names[u["name"]]} for u in defs["users"] if u["name"] in names],
        "vhosts": [{**v, "name": vhost} for v in defs["vhosts"]],
        "permissions": [
            {**p, "user": names[p["user"]], "vhost": vhost} for p in defs["permissions"] if p["user"] in names
        ],
        **{kind: [{**item, "vhost": vhost} for item in defs[kind]] for kind in TOPOLOGY_KINDS},
    }
    # compose.yaml passes each service its password from .env: the example's development ones
    example = (DEPLOY / "compose.env.example").read_text().splitlines()
    env = dict(line.strip().split("=", 1) for line in example if line.strip() and not line.startswith("#"))
    passwords = {user: env[f"{user.upper()}_BROKER_PASSWORD"] for user in SERVICE_USERS}
    base = urlsplit(BASE_URL)
    try:
        # From standard input: Debian's rabbitmqctl runs as the rabbitmq user, who cannot read tmp dirs.
        _ctl_out("import_definitions", "--format", "json", stdin=json.dumps(imported))

        def imported_yet() -> bool:  # the import is asynchronous; the bindings come last
            if vhost not in _ctl_out("list_vhosts").split():
                return False
            granted = {line.split("\t")[0] for line in _ctl_out("list_permissions", "-p", vhost).splitlines()}
            bound = _ctl_out("list_bindings", "-p", vhost, "source_name", "destination_name").split()
            wanted = {b["source"] for b in defs["bindings"]}
            return set(names.values()) <= granted and wanted <= set(bound)

        deadline = time.monotonic() + 30
        while not imported_yet():
            assert time.monotonic() < deadline, "the definitions were not imported within 30 s"
            time.sleep(0.2)
        yield Deployed(vhost, names, passwords, f"{base.hostname}:{base.port or 5672}")
    finally:
        # Whatever the import got to: remove it all, without masking the test's own failure.
        for args in (("delete_vhost", vhost), *(("delete_user", name) for name in names.values())):
            subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, timeout=60)


class WatchedBus(RabbitBus):
    """A service's bus that, besides its metrics hook, tells the test of each message it dead-letters."""

    def __init__(self, settings: Settings, name: str, seen: Callable[[str], None]) -> None:
        self._seen = seen
        self._hook: Callable[[str], None] | None = None
        super().__init__(settings, name)

    @property
    def on_dead_letter(self) -> Callable[[str], None]:
        return self._refused

    @on_dead_letter.setter
    def on_dead_letter(self, hook: Callable[[str], None] | None) -> None:
        self._hook = hook

    def _refused(self, reason: str) -> None:
        if self._hook is not None:
            self._hook(reason)
        self._seen(reason)
