"""Transport security: TLS settings, where the broker password comes from, and where it never goes.

The password must not reach a log line, an error message, a settings repr or a process's command
line. The checks here grep everything a failing connection writes (service logs at debug level,
pika's own included, and the CLI's error output) for it.
"""

from __future__ import annotations

import io
import logging
import os
import re
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pika
import pytest
import structlog
from pydantic import ValidationError
from typer.testing import CliRunner

from fedmq.common.bus.connection import BrokerConnection, connection_parameters
from fedmq.common.errors import BrokerUnavailable, ConfigError
from fedmq.common.logging import configure_logging
from fedmq.common.settings import Settings, redact_url
from fedmq.common.tls import client_context
from fedmq.services.cli.main import app
from tests.rabbit_cluster import free_ports
from tests.tls_certs import Certs, make_certs

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-Pa55word"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def settings(**values: Any) -> Settings:
    return Settings(_env_file=None, **values)


def password_file(tmp_path: Path, text: str = SECRET + "\n") -> Path:
    path = tmp_path / "password"
    path.write_text(text)
    return path


# -- where the password comes from --------------------------------------------------------------


def test_a_password_file_fills_in_a_url_that_names_only_the_user(tmp_path: Path) -> None:
    s = settings(broker_url="amqp://learner@rabbit-1/fedmq,amqp://learner@rabbit-2/fedmq",
                 broker_password_file=password_file(tmp_path))
    nodes = connection_parameters(s, "test")
    assert [(p.host, p.credentials.username, p.credentials.password) for p in nodes] == [
        ("rabbit-1", "learner", SECRET), ("rabbit-2", "learner", SECRET),
    ]
    assert [p.virtual_host for p in nodes] == ["fedmq", "fedmq"]


def test_the_password_file_is_read_again_at_each_connect(tmp_path: Path) -> None:
    path = password_file(tmp_path)
    s = settings(broker_url="amqp://learner@rabbit/fedmq", broker_password_file=path)
    path.write_text("rotated\n")
    (node,) = connection_parameters(s, "test")
    assert node.credentials.password == "rotated"


def test_the_password_setting_fills_in_a_url_with_a_url_encoded_user() -> None:
    s = settings(broker_url="amqp://fed%40mq@rabbit/fedmq", broker_password=SECRET)
    (node,) = connection_parameters(s, "test")
    assert (node.credentials.username, node.credentials.password) == ("fed@mq", SECRET)
    assert SECRET not in repr(s) and SECRET not in str(s)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"broker_url": "amqp://u:pw@h/v", "broker_password": "x"}, "take it out of FEDMQ_BROKER_URL"),
        ({"broker_url": "amqp://u@h/v"}, "names user 'u' but no password"),
        ({"broker_url": "amqp://h/v", "broker_password": "x"}, "names no user"),
        ({"broker_url": "amqp://u@h/v", "broker_password": "x", "broker_password_file": "/x"}, "not both"),
        ({"broker_url": "amqp://u@h/v", "broker_password_file": "/nonexistent/pw"}, "cannot read it"),
    ],
)
def test_a_password_given_twice_or_nowhere_is_a_clear_error(values: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(says)) as info:
        settings(**values)
    assert "pw@" not in str(info.value)


def test_an_empty_password_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="the file is empty"):
        settings(broker_url="amqp://u@h/v", broker_password_file=password_file(tmp_path, "\n"))


# -- TLS -------------------------------------------------------------------------------------------


def test_an_amqps_url_verifies_the_broker_by_its_host_name(certs: Certs) -> None:
    s = settings(broker_url="amqps://u:pw@rabbit.example:5671/fedmq", tls_ca_file=certs.ca,
                 tls_cert_file=certs.cert("client"), tls_key_file=certs.key("client"))
    (node,) = connection_parameters(s, "test")
    assert node.ssl_options is not None and node.port == 5671
    assert node.ssl_options.server_hostname == "rabbit.example"
    context = node.ssl_options.context
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert any("fedmq CA" in str(ca["subject"]) for ca in context.get_ca_certs())


def test_the_host_name_check_can_be_turned_off_but_not_the_verification(certs: Certs) -> None:
    s = settings(broker_url="amqps://u:pw@10.0.0.7/fedmq", tls_ca_file=certs.ca, tls_verify_hostname=False)
    (node,) = connection_parameters(s, "test")
    assert node.ssl_options is not None
    assert not node.ssl_options.context.check_hostname
    assert node.ssl_options.context.verify_mode == ssl.CERT_REQUIRED


def test_an_amqp_url_stays_plain() -> None:
    (node,) = connection_parameters(settings(broker_url="amqp://u:pw@h/v"), "test")
    assert node.ssl_options is None


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ({"tls_ca_file": "/nonexistent/ca.pem"}, "FEDMQ_TLS_CA_FILE=/nonexistent/ca.pem: no such file"),
        ({"tls_ca_file": "{client_key}"}, "not a PEM CA certificate"),
        ({"tls_cert_file": "{client}"}, "set both or neither"),
        ({"tls_cert_file": "{client}", "tls_key_file": "{server_key}"}, "not a PEM certificate and its"),
        ({"tls_cert_file": "{client}", "tls_key_file": "/no/k"}, "FEDMQ_TLS_KEY_FILE=/no/k: no such"),
    ],
)
def test_a_missing_or_invalid_certificate_file_is_named(
    certs: Certs, files: dict[str, str], says: str
) -> None:
    paths = {"{client}": certs.cert("client"), "{client_key}": certs.key("client"),
             "{server_key}": certs.key("server")}
    values = {k: paths.get(v, v) for k, v in files.items()}
    with pytest.raises(ValidationError, match=re.escape(says)):
        settings(broker_url="amqps://u:pw@h/v", **values)


def test_an_encrypted_key_is_refused_instead_of_prompting(certs: Certs, tmp_path: Path) -> None:
    encrypted = tmp_path / "enc.key"
    subprocess.run(["openssl", "pkey", "-in", str(certs.key("client")), "-aes256", "-passout", "pass:x",
                    "-out", str(encrypted)], check=True, capture_output=True)
    with pytest.raises(ConfigError, match="is encrypted"):
        client_context(certs.ca, certs.cert("client"), encrypted)


def test_tls_files_with_a_plain_url_say_to_use_amqps(certs: Certs) -> None:
    with pytest.raises(ValidationError, match="use amqps://"):
        settings(broker_url="amqp://u:pw@h/v", tls_ca_file=certs.ca)


# -- where the password never goes -----------------------------------------------------------------


@pytest.mark.parametrize("url", [
    f"amqp://u:{SECRET}@h:5672/v", f"amqp://u:{SECRET}@h:notaport/v", f"amqps://u:{SECRET}@[::1]:5671/v",
    f"amqp://u:{SECRET}:more@h/v",
])
def test_redact_url_hides_the_password_however_malformed_the_url(url: str) -> None:
    assert SECRET not in redact_url(url)
    assert redact_url(url).startswith(url.split(":")[0] + "://u:***@")


def test_a_rejected_setting_does_not_echo_the_url() -> None:
    with pytest.raises(ValidationError) as info:
        settings(broker_url=f"http://u:{SECRET}@h/v", heartbeat_s="x")
    assert SECRET not in str(info.value)


def test_the_cli_prints_a_bad_setting_without_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDMQ_BROKER_URL", f"http://u:{SECRET}@h/v")
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 2
    assert "must start with amqp://" in result.output and SECRET not in result.output


def test_no_command_takes_a_credential_on_its_command_line() -> None:
    """Arguments show in `ps`: the broker URL and password come from the environment or a file only."""
    import typer.main

    group = typer.main.get_command(app)
    assert group.commands  # type: ignore[attr-defined]
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        for param in command.params:
            words = " ".join([param.name or "", *getattr(param, "opts", [])]).lower()
            assert not re.search(r"password|secret|broker|url|credential|token", words), (name, words)


def test_tracebacks_in_console_logs_show_no_local_variables() -> None:
    stream = io.StringIO()
    configure_logging("console", "info", stream)

    def connect(password: str) -> None:
        raise RuntimeError("refused")

    try:
        connect(SECRET)
    except RuntimeError:
        structlog.get_logger("test").exception("connect_failed")
    assert "connect_failed" in stream.getvalue() and "refused" in stream.getvalue()
    assert SECRET not in stream.getvalue()


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_failing_connection_logs_no_password_even_at_debug(fmt: str, tmp_path: Path) -> None:
    (port,) = free_ports(1)  # nothing listens there
    stream = io.StringIO()
    configure_logging(fmt, "debug", stream)  # type: ignore[arg-type]
    logging.getLogger("pika").setLevel(logging.DEBUG)  # pika's own logs too, not only fedmq's
    s = settings(broker_url=f"amqp://u:{SECRET}@127.0.0.1:{port}/v,amqp://u:{SECRET}@localhost:{port}/v",
                 retry_initial_s=0.05, retry_max_s=0.05)
    conn = BrokerConnection(s, "leak-check", on_open=lambda: None, on_lost=lambda: None)
    thread = threading.Thread(target=conn.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while stream.getvalue().count("broker_connection_lost") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    conn.stop()
    thread.join(10)
    with pytest.raises(BrokerUnavailable) as info:
        conn.connect()
    out = stream.getvalue()
    assert out.count("broker_connection_lost") >= 2 and "u:***@127.0.0.1" in out
    assert SECRET not in out and SECRET not in str(info.value)
    assert "u:***@localhost" in str(info.value)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`fedmq ARGS` as a process, logging at debug level."""
    return subprocess.run(
        [sys.executable, "-m", "fedmq.services.cli.main", *args], cwd=REPO, text=True, capture_output=True,
        timeout=120, env={**os.environ, "FEDMQ_LOG_LEVEL": "debug", **env},
    )


@pytest.mark.parametrize("command", [["status"], ["scheduler"]])
def test_an_unreachable_broker_is_reported_without_the_password(command: list[str], tmp_path: Path) -> None:
    (port,) = free_ports(1)
    for env in (
        {"FEDMQ_BROKER_URL": f"amqp://u:{SECRET}@127.0.0.1:{port}/v"},
        {"FEDMQ_BROKER_URL": f"amqp://u@127.0.0.1:{port}/v",
         "FEDMQ_BROKER_PASSWORD_FILE": str(password_file(tmp_path))},
    ):
        proc = run_cli(*command, env={**env, "FEDMQ_STATE_DIR": str(tmp_path / "state")})
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "cannot reach RabbitMQ at amqp://u" in proc.stderr
        assert SECRET not in proc.stdout + proc.stderr


@pytest.mark.rabbitmq
def test_a_wrong_password_is_reported_without_it(tmp_path: Path) -> None:
    from urllib.parse import urlsplit

    from tests.rabbit import BASE_URL, require_rabbitmq

    require_rabbitmq()
    base = urlsplit(BASE_URL)
    url = f"amqp://fedmq-nobody@{base.hostname}:{base.port or 5672}/fedmq-none"
    env = {"FEDMQ_BROKER_URL": url, "FEDMQ_BROKER_PASSWORD_FILE": str(password_file(tmp_path)),
           "FEDMQ_STATE_DIR": str(tmp_path / "state")}
    for command in (["status"], ["scheduler"]):
        proc = run_cli(*command, env=env)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "ACCESS_REFUSED" in proc.stderr or "credentials" in proc.stderr, proc.stderr
        assert SECRET not in proc.stdout + proc.stderr
    # And pika itself was given the password: the broker refused the login, not a missing one.
    (node,) = connection_parameters(Settings(_env_file=None, broker_url=url, broker_password=SECRET), "t")
    assert isinstance(node.credentials, pika.PlainCredentials) and node.credentials.password == SECRET
