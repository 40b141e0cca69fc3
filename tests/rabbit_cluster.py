"""A RabbitMQ cluster of its own on this machine, for tests that stop nodes under a running job.

    node i: fedmq-<tag>-<i>@localhost   AMQP 127.0.0.1:<amqp i>   distribution <dist i>
            its database, logs, config and (empty) plugin list under root/node-<i>
    one Erlang cookie, root/.erlang.cookie, found as $HOME's by the nodes and the CLI calls

Its own names, ports, cookie and directories: it can neither reach nor disturb the broker the
other tests use (rabbit@localhost), and stopping the cluster stops only the nodes started here.
Nodes 2..n join node 1 (`stop_app`, `join_cluster`, `start_app`) before any queue exists, so
every quorum queue declared later has a member on each node.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ci import under_ci

START_TIMEOUT_S = 120  # a node boots in a few seconds; a loaded 2-core machine may take longer
CTL_TIMEOUT_S = 120


def rabbitmq_scripts() -> Path | None:
    """The folder of rabbitmq-server and rabbitmqctl themselves, not a wrapper that changes user."""
    override = os.environ.get("FEDMQ_TEST_RABBITMQ_SBIN")
    # Debian's /usr/sbin scripts run the tools as the rabbitmq user with its own cookie: skip them.
    candidates = [Path(override)] if override else [Path("/usr/lib/rabbitmq/bin")]
    found = shutil.which("rabbitmq-server")
    if found is not None:
        candidates.append(Path(os.path.realpath(found)).parent)
    for folder in candidates:
        if (folder / "rabbitmq-server").is_file() and (folder / "rabbitmqctl").is_file():
            return folder
    return None


def require_rabbitmq_server() -> Path:
    """The scripts' folder; else skip loudly, or fail under CI."""
    folder = rabbitmq_scripts()
    if folder is not None:
        return folder
    reason = "rabbitmq-server is not installed (or set FEDMQ_TEST_RABBITMQ_SBIN to its folder)"
    if under_ci():
        pytest.fail(f"a RabbitMQ installation is required under CI: {reason}")
    pytest.skip(f"SKIPPING RabbitMQ CLUSTER TEST: {reason}")


def free_ports(count: int) -> list[int]:
    """`count` ports free now, below the ephemeral range so that no outgoing socket takes one later."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    ephemeral = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(20000, ephemeral)
        with socket.socket() as s, suppress(OSError):
            s.bind(("127.0.0.1", port))
            if port not in ports:
                ports.append(port)
    return ports


@dataclass
class Node:
    name: str
    amqp_port: int
    dist_port: int
    home: Path  # its database, logs and config

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/%2F"


class RabbitCluster:
    """`size` RabbitMQ nodes clustered together; `stop_app`/`start_app` one at a time."""

    def __init__(self, root: Path, size: int = 3, conf: str = "") -> None:
        self.scripts = require_rabbitmq_server()
        self.root = root
        self.conf = conf  # more rabbitmq.conf lines for every node (a TLS listener)
        tag = secrets.token_hex(3)
        ports = free_ports(2 * size)
        self.nodes = [
            Node(f"fedmq-{tag}-{i + 1}@localhost", ports[i], ports[size + i], root / f"node-{i + 1}")
            for i in range(size)
        ]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def broker_url(self) -> str:
        """FEDMQ_BROKER_URL naming every node, in order."""
        return ",".join(node.url for node in self.nodes)

    def ctl(self, node: Node, *args: str, tool: str = "rabbitmqctl") -> subprocess.CompletedProcess[str]:
        """A CLI command against one node; raises with its output when it fails."""
        proc = subprocess.run(
            [str(self.scripts / tool), "-n", node.name, *args], env=self._env(), capture_output=True,
            text=True, timeout=CTL_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{tool} -n {node.name} {' '.join(args)}: {proc.stdout}{proc.stderr}")
        return proc

    def start(self) -> None:
        """Boot every node, then join the others to the first."""
        self.root.mkdir(parents=True, exist_ok=True)
        cookie = self.root / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(20).upper())
        cookie.chmod(0o400)
        for node in self.nodes:
            self.procs.append(self._boot(node))
        for node in self.nodes:
            try:
                self.ctl(node, "wait", str(node.home / "pid"), "--timeout", str(START_TIMEOUT_S))
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\nsee {node.home / 'server.out'} and {node.home / 'log'}") from None
        for node in self.nodes[1:]:
            self.ctl(node, "stop_app")
            self.ctl(node, "join_cluster", self.nodes[0].name)
            self.ctl(node, "start_app")
        self.ctl(self.nodes[0], "await_online_nodes", str(len(self.nodes)), "--timeout", str(START_TIMEOUT_S))

    def stop_app(self, node: Node) -> None:
        """Stop RabbitMQ on one node (its Erlang VM stays): its clients are disconnected."""
        self.ctl(node, "stop_app")

    def start_app(self, node: Node) -> None:
        """Start a stopped node's RabbitMQ again and wait until it serves."""
        self.ctl(node, "start_app")
        self.ctl(node, "await_startup", "--timeout", str(START_TIMEOUT_S))

    def quorum_critical(self, node: Node) -> bool:
        """Would stopping `node` now leave some quorum queue without a majority?"""
        try:
            self.ctl(node, "check_if_node_is_quorum_critical", tool="rabbitmq-queues")
        except RuntimeError:
            return True
        return False

    def connected(self, node: Node) -> list[str]:
        """The names of the client connections on `node` (by the port they came in on)."""
        # Any node lists the whole cluster's connections: tell them apart by the node's port.
        out = self.ctl(node, "-q", "list_connections", "port", "client_properties", "--formatter", "json")
        names = []
        for row in json.loads(out.stdout or "[]"):
            props = {key: value for key, _, value in row["client_properties"]}
            if row["port"] == node.amqp_port:
                names.append(str(props.get("connection_name", "?")))
        return names

    def stop(self) -> None:
        """Stop every node started here (the VM too), killing any that does not stop in time."""
        for node, proc in zip(self.nodes, self.procs, strict=False):
            if proc.poll() is None:
                with suppress(RuntimeError, subprocess.TimeoutExpired):
                    self.ctl(node, "stop", str(node.home / "pid"))
        for proc in self.procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)

    def _env(self) -> dict[str, str]:
        # HOME holds the cluster's cookie; no RABBITMQ_* from the caller may leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        return {**env, "HOME": str(self.root), "ERL_EPMD_ADDRESS": "127.0.0.1"}

    def _boot(self, node: Node) -> subprocess.Popen[bytes]:
        node.home.mkdir(parents=True)
        listener = f"listeners.tcp.default = 127.0.0.1:{node.amqp_port}\n"
        (node.home / "rabbitmq.conf").write_text(listener + self.conf)
        (node.home / "enabled_plugins").write_text("[].\n")  # no management or prometheus listeners
        (node.home / "rabbitmq-env.conf").write_text("")  # not the system's (it names the main node)
        env = {
            **self._env(),
            "RABBITMQ_NODENAME": node.name,
            "RABBITMQ_DIST_PORT": str(node.dist_port),
            "RABBITMQ_CONF_ENV_FILE": str(node.home / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(node.home / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(node.home / "advanced.config"),  # none
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(node.home / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(node.home / "mnesia"),
            "RABBITMQ_LOG_BASE": str(node.home / "log"),
            "RABBITMQ_PID_FILE": str(node.home / "pid"),
            "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        out = open(node.home / "server.out", "wb")  # noqa: SIM115 - the server writes to it until it stops
        try:
            return subprocess.Popen([str(self.scripts / "rabbitmq-server")], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()


@contextmanager
def rabbit_cluster(root: Path, size: int = 3, conf: str = "") -> Iterator[RabbitCluster]:
    """A started cluster of `size` nodes, stopped afterwards whatever happens."""
    cluster = RabbitCluster(root, size, conf)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
