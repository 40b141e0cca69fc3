"""RabbitMQ for tests: a fresh vhost per test, a loud skip without a broker, a failure under CI.

Every test that gets here must carry the `rabbitmq` marker (tests/tiers.py adds it), so that
`pytest -m "not rabbitmq"` is exactly the broker-free tier; one that does not fails, broker or not.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

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


@contextmanager
def fresh_vhost() -> Iterator[str]:
    """A new vhost with full rights for the test user; its URL. Deleted afterwards."""
    require_rabbitmq()
    name = f"fedmq-test-{uuid.uuid4().hex[:10]}"
    user = urlsplit(BASE_URL).username or "guest"
    _ctl("add_vhost", name)
    _ctl("set_permissions", "-p", name, user, ".*", ".*", ".*")
    try:
        yield f"{BASE_URL.rstrip('/')}/{name}"
    finally:
        _ctl("delete_vhost", name)


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
