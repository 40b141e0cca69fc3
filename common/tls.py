"""TLS to the broker: one client SSLContext from the FEDMQ_TLS_* files, with errors that say which.

    amqps://host:5671/vh  ─▶  CA file (else the system's CAs) verifies the broker's certificate,
                              its name checked against the URL's host (unless turned off),
                              client certificate + key presented when the broker asks for one
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

from fedmq.common.errors import ConfigError


def _readable(setting: str, path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"{setting}={path}: no such file")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{setting}={path}: cannot read it ({exc.strerror})") from None


def _no_prompt(key_file: Path) -> Callable[[], bytes]:
    # Without a callback, OpenSSL would ask for an encrypted key's passphrase on the terminal.
    def refuse() -> bytes:
        raise ConfigError(
            f"FEDMQ_TLS_KEY_FILE={key_file} is encrypted: give an unencrypted key, readable by this user only"
        )

    return refuse


def client_context(
    ca_file: Path | None, cert_file: Path | None, key_file: Path | None, *, verify_hostname: bool = True
) -> ssl.SSLContext:
    """A context that verifies the broker (TLS 1.2 or later) and presents the client certificate, if any.

    ConfigError naming the setting and the file when one is missing, unreadable or not what it should be.
    """
    if (cert_file is None) != (key_file is None):
        raise ConfigError("FEDMQ_TLS_CERT_FILE and FEDMQ_TLS_KEY_FILE go together: set both or neither")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)  # CERT_REQUIRED, hostname check on
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file is not None:
        _readable("FEDMQ_TLS_CA_FILE", ca_file)
        try:
            context.load_verify_locations(cafile=str(ca_file))
        except ssl.SSLError as exc:
            raise ConfigError(
                f"FEDMQ_TLS_CA_FILE={ca_file}: not a PEM CA certificate ({exc.reason or exc})"
            ) from None
    if cert_file is not None and key_file is not None:
        _readable("FEDMQ_TLS_CERT_FILE", cert_file)
        _readable("FEDMQ_TLS_KEY_FILE", key_file)
        try:
            context.load_cert_chain(str(cert_file), str(key_file), password=_no_prompt(key_file))
        except ssl.SSLError as exc:
            raise ConfigError(
                f"FEDMQ_TLS_CERT_FILE={cert_file} with FEDMQ_TLS_KEY_FILE={key_file}: not a PEM certificate "
                f"and its private key ({exc.reason or exc})"
            ) from None
    context.check_hostname = verify_hostname
    return context
