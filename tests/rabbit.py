"""RabbitMQ for tests: a fresh vhost per test, a loud skip without a broker, a failure under CI."""

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


def require_rabbitmq() -> None:
    reason = _unavailable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"RabbitMQ is required under CI=true: {reason}")
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


def dead_letters(url: str) -> list[tuple[dict, bytes]]:
    """Drain fedmq.dead on a vhost: (headers, body) of every dead-lettered message."""
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        out = []
        while True:
            method, props, body = ch.basic_get("fedmq.dead", auto_ack=True)
            if method is None:
                return out
            out.append((dict(props.headers or {}), body))
    finally:
        conn.close()
