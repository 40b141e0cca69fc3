"""A job over amqps: a RabbitMQ node of the test's own with a TLS listener that verifies its peers.

    tmp_path/certs   CA, server (DNS:localhost) and client certificates, an untrusted CA (openssl)
    tmp_path/rabbit  one node: fedmq-<tag>-1@localhost, AMQP on 127.0.0.1, TLS on 127.0.0.1:<tls>
                     as deploy/rabbitmq/tls.conf says (verify_peer, fail_if_no_peer_cert, TLS 1.2+),
                     its own database, logs, config and cookie
    services         scheduler, aggregator, learner and CLI over amqps://fedmq-tls@localhost:<tls>,
                     the password in FEDMQ_BROKER_PASSWORD_FILE, the certificates in FEDMQ_TLS_*

The machine's own broker and its configuration are never touched. Where TLS cannot be set up here
(no rabbitmq-server, no openssl, an Erlang without its ssl application) the test skips loudly, and
fails under CI; once the node is up, anything that goes wrong is a failure.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fedmq.common.bus.connection import BrokerConnection
from fedmq.common.errors import BrokerUnavailable
from fedmq.common.settings import Settings
from tests.ci import under_ci
from tests.e2e.cluster import Cluster
from tests.rabbit_cluster import free_ports, rabbit_cluster
from tests.tls_certs import Certs, make_certs

pytestmark = pytest.mark.rabbitmq

TLS_CONF = Path(__file__).resolve().parents[2] / "deploy" / "rabbitmq" / "tls.conf"
USER = "fedmq-tls"
CLIENT_CERT = ("FEDMQ_TLS_CERT_FILE", "FEDMQ_TLS_KEY_FILE")
JOB = """\
name: over-tls
seed: 1
model: {name: mlp, hidden: [32]}
data: {name: digits, partition: {kind: iid}}
clients: {total: 3}
rounds: 2
train: {epochs: 1, batch_size: 64, lr: 0.1}
round_timeout_s: 120
"""


def require_erlang_ssl() -> None:
    """RabbitMQ's TLS listener needs Erlang's ssl application; skip loudly (fail under CI) without it."""
    erl = shutil.which("erl")
    reason = None
    if erl is None:
        reason = "erl is not on PATH, so whether Erlang has its ssl application cannot be checked"
    else:
        probe = subprocess.run(
            [erl, "-noshell", "-eval", "case ssl:start() of ok -> halt(0); _ -> halt(1) end."],
            capture_output=True, timeout=60,
        )
        if probe.returncode != 0:
            reason = "Erlang's ssl application does not start (Debian: apt-get install -y erlang-ssl)"
    if reason is None:
        return
    if under_ci():
        pytest.fail(f"TLS is required under CI: {reason}")
    pytest.skip(f"SKIPPING TLS TEST: RabbitMQ's TLS listener cannot be configured here: {reason}")


def tls_conf(certs: Certs, port: int) -> str:
    """deploy/rabbitmq/tls.conf, the one compose mounts, with this test's files and port."""
    text = TLS_CONF.read_text()
    for deployed, here in {
        "listeners.ssl.default = 5671": f"listeners.ssl.default = 127.0.0.1:{port}",
        "/etc/rabbitmq/tls/ca.pem": str(certs.ca),
        "/etc/rabbitmq/tls/server.pem": str(certs.cert("server")),
        "/etc/rabbitmq/tls/server.key": str(certs.key("server")),
    }.items():
        assert deployed in text, f"{TLS_CONF} no longer says {deployed!r}: update the test"
        text = text.replace(deployed, here)
    return text


def tls_env(certs: Certs, password_file: Path, port: int, host: str = "localhost") -> dict[str, str]:
    return {
        "FEDMQ_BROKER_URL": f"amqps://{USER}@{host}:{port}/%2F",
        "FEDMQ_BROKER_PASSWORD_FILE": str(password_file),
        # one broker user for every role here: each service takes its peers' messages from it
        **{f"FEDMQ_{role}_USERS": USER for role in ("SCHEDULER", "AGGREGATOR", "LEARNER", "CLI")},
        "FEDMQ_TLS_CA_FILE": str(certs.ca),
        "FEDMQ_TLS_CERT_FILE": str(certs.cert("client")),
        "FEDMQ_TLS_KEY_FILE": str(certs.key("client")),
    }


def connects(env: dict[str, str]) -> str | None:
    """None if a fedmq connection opens with these settings; else BrokerUnavailable's message."""
    values: dict[str, Any] = {k.removeprefix("FEDMQ_").lower(): v for k, v in env.items()}
    settings = Settings(_env_file=None, **values)
    conn = BrokerConnection(settings, "tls-probe", on_open=lambda: None, on_lost=lambda: None)
    try:
        conn.connect()
    except BrokerUnavailable as exc:
        return str(exc)
    conn.drop()
    return None


def test_a_job_runs_over_amqps_with_verified_certificates_on_both_sides(tmp_path: Path) -> None:
    require_erlang_ssl()
    certs = make_certs(tmp_path / "certs")
    (tls_port,) = free_ports(1)
    password = secrets.token_hex(16)  # a urlsafe one may start with "-": rabbitmqctl takes it for an option
    password_file = tmp_path / "broker-password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    with rabbit_cluster(tmp_path / "rabbit", size=1, conf=tls_conf(certs, tls_port)) as rabbit:
        node = rabbit.nodes[0]
        rabbit.ctl(node, "add_user", USER, password)
        rabbit.ctl(node, "set_permissions", "-p", "/", USER, ".*", ".*", ".*")
        env = tls_env(certs, password_file, tls_port)

        # What a client that cannot prove itself, or that should not trust the broker, gets.
        assert connects(env) is None
        no_client_cert = {k: v for k, v in env.items() if k not in CLIENT_CERT}
        assert connects(no_client_cert) is not None, "the broker must refuse a client without a certificate"
        refused = connects({**env, "FEDMQ_TLS_CA_FILE": str(certs.other_ca)})
        assert refused is not None and "FEDMQ_TLS_CA_FILE" in refused, refused
        by_ip = tls_env(certs, password_file, tls_port, host="127.0.0.1")  # the certificate names localhost
        assert connects(by_ip) is not None, "the broker's name must be checked"
        assert connects({**by_ip, "FEDMQ_TLS_VERIFY_HOSTNAME": "false"}) is None

        c = Cluster(env["FEDMQ_BROKER_URL"], tmp_path, env)
        try:
            for service in ("scheduler", "aggregator", "learner"):
                c.start(service)
            c.wait_learners(1, timeout=120)
            spec = tmp_path / "job.yaml"
            spec.write_text(JOB)
            done = c.fedmq("submit", str(spec), "--watch", timeout=300)
            logs = "\n".join(c.log(s)[-2000:] for s in ("scheduler", "aggregator", "learner"))
            assert done.returncode == 0, done.stdout + done.stderr + logs
            # Every fedmq connection the node holds came in over TLS with the client certificate.
            out = rabbit.ctl(node, "-q", "list_connections", "user", "ssl", "peer_cert_subject",
                             "--formatter", "json").stdout
            rows = json.loads(out or "[]")
            assert len(rows) >= 3, rows
            for row in rows:
                assert row["user"] == USER and row["ssl"] is True, row
                assert "CN=fedmq-services" in str(row["peer_cert_subject"]), row
            # `ps` shows no password, and neither does the environment: it holds the file's name only.
            for name, proc in c.procs.items():
                for view in ("cmdline", "environ"):
                    shown = Path(f"/proc/{proc.pid}/{view}")
                    if shown.exists():
                        assert password.encode() not in shown.read_bytes(), f"{name}'s {view}"
            assert c.stop_all() == {name: 0 for name in c.procs}
            for name in c.procs:
                assert password not in c.log(name), f"{name}'s log holds the broker password"
            assert password not in done.stdout + done.stderr
        finally:
            for proc in c.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
