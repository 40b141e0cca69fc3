"""Throw-away certificates for TLS tests, made by scripts/make-tls-certs.sh (openssl), as a deployment would.

    root/ca.pem ─signs─▶ root/rabbitmq/server.pem (DNS:localhost, serverAuth)
                └signs─▶ root/fedmq/client.pem    (CN=fedmq-services, clientAuth)
    root/other/ca.pem    a CA nobody trusts: what a man in the middle would show

Keys are unencrypted P-256 keys, valid for two days. Without openssl the test skips loudly,
or fails under CI (tests/ci.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ci import under_ci

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make-tls-certs.sh"
FOLDER = {"server": "rabbitmq", "client": "fedmq"}


@dataclass(frozen=True)
class Certs:
    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def other_ca(self) -> Path:
        return self.root / "other" / "ca.pem"

    def cert(self, name: str) -> Path:
        """server or client."""
        return self.root / FOLDER[name] / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.root / FOLDER[name] / f"{name}.key"


def require_openssl() -> None:
    if shutil.which("openssl") is not None:
        return
    reason = "the openssl command is missing (apt-get install -y openssl)"
    if under_ci():
        pytest.fail(f"required under CI: {reason}")
    pytest.skip(f"SKIPPING TLS TEST: {reason}")


def _make(root: Path, *names: str) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), str(root), *names], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "DAYS": "2"})
    assert proc.returncode == 0, f"{SCRIPT.name}: {proc.stdout}{proc.stderr}"


def make_certs(root: Path) -> Certs:
    """A CA, a server certificate for localhost, a client certificate, and an untrusted CA."""
    require_openssl()
    _make(root, "localhost")
    _make(root / "other", "localhost")
    return Certs(root)
