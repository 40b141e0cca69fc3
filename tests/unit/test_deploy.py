"""The deployment files (compose.yaml and deploy/), checked without a Docker engine.

compose.yaml is validated by Debian's `docker-compose config` and by the Compose Specification's
JSON schema (vendored by the check-jsonschema package); the Prometheus configuration and every
dashboard query by `promtool` (Debian package `prometheus`). A missing tool is a loud skip, and a
failure under CI (tests/ci.py). The RabbitMQ definitions are checked against what the bus code declares,
publishes and consumes, and, where a broker runs, by running the services as their own users.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from fedmq.common.bus import blob, topology
from fedmq.common.metrics import DURATION_BUCKETS, Metrics
from fedmq.common.settings import Settings
from tests.ci import under_ci

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = REPO / "compose.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
RABBITMQ_CONF = DEPLOY / "rabbitmq" / "rabbitmq.conf"
DEFINITIONS = DEPLOY / "rabbitmq" / "definitions.json"
COMPOSE_ENV = DEPLOY / "compose.env.example"
COMPOSE_TLS = DEPLOY / "compose.tls.yaml"
TLS_CONF = DEPLOY / "rabbitmq" / "tls.conf"
ENABLED_PLUGINS = DEPLOY / "rabbitmq" / "enabled_plugins"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "fedmq.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "fedmq.yml"

DATASOURCE_UID = "fedmq-prometheus"
VHOST = "fedmq"
FEDMQ_SERVICES = ("scheduler", "aggregator", "learner", "learner-gpu0", "learner-gpu1", "cli")
SERVICE_USERS = ("scheduler", "aggregator", "learner", "cli")
METRIC_NAME = re.compile(r"\bfedmq_[a-z_]+")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def _missing(what: str, how: str) -> None:
    """A tool the check needs is missing: fail under CI, else skip loudly."""
    message = f"{what} is missing: {how}"
    if under_ci():
        pytest.fail(f"required under CI: {message}")
    pytest.skip(f"SKIPPING DEPLOY CHECK: {message}")


def _tool(name: str, debian_package: str) -> str:
    found = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/bin") / name, Path("/usr/local/bin") / name) if p.is_file()), None
    )
    if found is None:
        _missing(name, f"install the Debian package `{debian_package}` (apt-get install -y {debian_package})")
    assert found is not None
    return found


INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def _example_env() -> dict[str, str]:
    """deploy/compose.env.example's variables, as compose would read them from .env."""
    pairs = (line.split("=", 1) for line in COMPOSE_ENV.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def _interpolate(text: str, env: dict[str, str]) -> str:
    """compose's ${VAR}, ${VAR:-default} and ${VAR:?error}; an unset required one fails the test."""
    def value(match: re.Match[str]) -> str:
        name, kind, rest = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        assert kind is None or "?" not in kind, f"${{{name}}} is required and unset: {rest}"
        return rest or ""

    return INTERPOLATION.sub(value, text)


def _load(path: Path) -> dict[str, Any]:
    # yaml resolves the x-* anchors and `<<` merges; the variables come from the example .env
    data = yaml.safe_load(_interpolate(path.read_text(), _example_env()))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load(COMPOSE)


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}  # `${X:-}` unset: empty


def _definitions() -> dict[str, Any]:
    data = json.loads(DEFINITIONS.read_text())
    assert isinstance(data, dict)
    return data


def _user_of(service: str) -> str:
    return "learner" if service.startswith("learner") else service


# -- compose.yaml -----------------------------------------------------------------------------


def test_compose_is_valid(compose: dict[str, Any]) -> None:
    """`docker-compose config -q` (Debian) and the Compose Specification schema, where available."""
    ran = []
    docker_compose = shutil.which("docker-compose")
    if docker_compose is not None:
        for layers in (["-f", str(COMPOSE)], ["-f", str(COMPOSE), "-f", str(COMPOSE_TLS)]):
            proc = subprocess.run(
                [docker_compose, *layers, "--profile", "gpu", "--profile", "tools", "config", "-q"],
                cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **_example_env()},
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr
        ran.append("docker-compose config")
    try:
        from importlib.resources import files

        import jsonschema

        schema_file = files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
        schema = json.loads(schema_file.read_text())
    except ModuleNotFoundError:
        pass
    else:
        validator = jsonschema.validators.validator_for(schema)(schema)
        for data in (compose, _load(COMPOSE_TLS)):
            errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
            assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
        ran.append("compose-spec schema")
    if not ran:
        _missing(
            "a compose validator",
            "install the Debian package `docker-compose` or the Python package `check-jsonschema` "
            "(it ships the Compose Specification's JSON schema)",
        )


def test_compose_has_the_whole_stack(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"rabbitmq", "prometheus", "grafana", *FEDMQ_SERVICES} <= services.keys()
    for name in FEDMQ_SERVICES:
        service = services[name]
        assert service["build"]["context"] == "."
        assert (REPO / service["build"]["dockerfile"]).resolve() == DOCKERFILE
        assert service["depends_on"]["rabbitmq"]["condition"] == "service_healthy", name
    for name in ("scheduler", "aggregator", "learner", "learner-gpu0", "learner-gpu1"):
        service = services[name]
        assert service["command"] in ([_user_of(name)], _user_of(name)), name
        env = _env(service)
        assert env["FEDMQ_METRICS_PORT"] == "9100", name
        assert env["FEDMQ_LOG_FORMAT"] == "json", name
        assert env["FEDMQ_STATE_DIR"] == "/var/lib/fedmq", name
    for name in ("scheduler", "aggregator", "learner", "cli"):
        assert services[name]["image"] == "fedmq:latest"
    # Scheduler and aggregator state outlive their containers: named volumes on the state dir.
    for name in ("scheduler", "aggregator"):
        mounts = [v.split(":") for v in services[name]["volumes"]]
        assert any(m[1] == "/var/lib/fedmq" and m[0] in compose["volumes"] for m in mounts), name
    assert services["cli"]["profiles"] == ["tools"]


def test_learner_scales_with_distinct_identities(compose: dict[str, Any]) -> None:
    learner = compose["services"]["learner"]
    # `--scale learner=N` needs no fixed name and no host port; each replica names itself after its
    # hostname (the container id) because neither node, replica nor hostname is pinned.
    for key in ("container_name", "ports", "hostname"):
        assert key not in learner, key
    assert not {"FEDMQ_NODE", "FEDMQ_REPLICA"} & _env(learner).keys()
    assert "profiles" not in learner


def test_gpu_learners_reserve_one_distinct_gpu_each(compose: dict[str, Any]) -> None:
    gpu = {n: s for n, s in compose["services"].items() if "gpu" in (s.get("profiles") or [])}
    assert set(gpu) == {"learner-gpu0", "learner-gpu1"}
    seen: list[str] = []
    for name, service in gpu.items():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        # `count: 1` would give every replica the same GPU: one service per GPU, by id.
        assert "count" not in device, name
        assert len(device["device_ids"]) == 1, name
        assert "gpu" in device["capabilities"]
        seen += device["device_ids"]
        assert _env(service)["FEDMQ_DEVICE"] == "cuda", "the container sees only its own GPU"
        assert "cuda" in service["build"]["args"]["BASE_IMAGE"]
        assert service["image"] != "fedmq:latest", "the CUDA image must not overwrite the CPU one"
        assert "container_name" not in service and "ports" not in service
    assert sorted(seen) == ["0", "1"]


def test_fedmq_environment_is_made_of_real_settings(compose: dict[str, Any]) -> None:
    fields = Settings.model_fields
    for name, service in compose["services"].items():
        env = {k: v for k, v in _env(service).items() if k.startswith("FEDMQ_")}
        if name in FEDMQ_SERVICES:
            assert "FEDMQ_BROKER_URL" in env, name
        unknown = [k for k in env if k.removeprefix("FEDMQ_").lower() not in fields]
        assert not unknown, f"{name}: {unknown} are not fedmq settings (common/settings.py)"
        # And the values pass the settings' own validation.
        values: dict[str, Any] = {k.removeprefix("FEDMQ_").lower(): v for k, v in env.items()}
        Settings(_env_file=None, **values)


def test_rabbitmq_service_mounts_the_deploy_files(compose: dict[str, Any]) -> None:
    rabbitmq = compose["services"]["rabbitmq"]
    assert rabbitmq["image"].startswith("rabbitmq:3.13-management")
    mounts = {v.split(":")[1]: v.split(":")[0] for v in rabbitmq["volumes"]}
    for target, source in {
        "/etc/rabbitmq/rabbitmq.conf": RABBITMQ_CONF,
        "/etc/rabbitmq/enabled_plugins": ENABLED_PLUGINS,
        "/etc/rabbitmq/definitions.json": DEFINITIONS,
    }.items():
        assert (REPO / mounts[target]).resolve() == source, target
    health = " ".join(rabbitmq["healthcheck"]["test"])
    assert "rabbitmq-diagnostics -q ping" in health
    published = {str(p).split(":")[-1] for p in rabbitmq["ports"]}
    assert {"5672", "15672"} <= published


def test_monitoring_services_mount_their_configuration(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prom = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert (REPO / prom["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS
    grafana = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert (REPO / grafana["/etc/grafana/provisioning"]).resolve() == DEPLOY / "grafana" / "provisioning"
    providers = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    (provider,) = providers
    assert provider["type"] == "file"
    assert (REPO / grafana[provider["options"]["path"]]).resolve() == DASHBOARD.parent
    env = _env(services["grafana"])
    assert env["GF_SECURITY_ADMIN_USER"] and env["GF_SECURITY_ADMIN_PASSWORD"]
    assert "3000:3000" in services["grafana"]["ports"] and "9090:9090" in services["prometheus"]["ports"]


# -- RabbitMQ -----------------------------------------------------------------------------------


def _rabbit_hash_matches(password: str, stored: str) -> bool:
    """rabbit_password_hashing_sha256: base64(salt (4 bytes) + sha256(salt + utf-8 password))."""
    raw = base64.b64decode(stored)
    salt, digest = raw[:4], raw[4:]
    return len(raw) == 36 and hashlib.sha256(salt + password.encode()).digest() == digest


def test_definitions_give_each_service_its_own_user() -> None:
    defs = _definitions()
    assert [v["name"] for v in defs["vhosts"]] == [VHOST]
    users = {u["name"]: u for u in defs["users"]}
    assert set(SERVICE_USERS) <= users.keys()
    assert "guest" not in users
    for name, user in users.items():
        assert "password" not in user, f"{name}: plain-text password in definitions"
        assert user["hashing_algorithm"] == "rabbit_password_hashing_sha256"
        assert len(base64.b64decode(user["password_hash"])) == 36
    for name in SERVICE_USERS:
        assert users[name]["tags"] in ([], ""), f"{name} needs no management access"
    admins = [n for n, u in users.items() if "administrator" in u["tags"]]
    assert admins, "an administrator for the management UI"
    perms = {(p["user"], p["vhost"]) for p in defs["permissions"]}
    for name in SERVICE_USERS:
        assert (name, VHOST) in perms, name
    assert {p["vhost"] for p in defs["permissions"]} == {VHOST}


def test_compose_broker_urls_log_in_as_the_service_users(compose: dict[str, Any]) -> None:
    users = {u["name"]: u for u in _definitions()["users"]}
    for name in FEDMQ_SERVICES:
        env = _env(compose["services"][name])
        url = urlsplit(env["FEDMQ_BROKER_URL"])
        assert (url.scheme, url.hostname, url.port) == ("amqp", "rabbitmq", 5672), name
        assert unquote(url.path.lstrip("/")) == VHOST, name
        assert url.username == _user_of(name), name
        assert url.password is None, f"{name}: the password goes in FEDMQ_BROKER_PASSWORD, not the URL"
        password = env["FEDMQ_BROKER_PASSWORD"]
        assert _rabbit_hash_matches(password, users[_user_of(name)]["password_hash"]), name


def test_compose_takes_each_service_password_from_the_env_file() -> None:
    """No password is written in compose.yaml: each comes from .env (deploy/compose.env.example), required."""
    raw = yaml.safe_load(COMPOSE.read_text())
    example = _example_env()
    for name in FEDMQ_SERVICES:
        env = _env(raw["services"][name])
        variable = f"{_user_of(name).upper()}_BROKER_PASSWORD"
        match = INTERPOLATION.fullmatch(env["FEDMQ_BROKER_PASSWORD"])
        assert match and match.group(1) == variable and match.group(2) == ":?", (name, env)
        assert "compose.env.example" in match.group(3), "the error must say where the passwords come from"
        assert example[variable], variable
        assert urlsplit(env["FEDMQ_BROKER_URL"]).username != "guest", name
    # Every variable compose.yaml needs is in the example; every example variable is used.
    used = {m.group(1) for m in INTERPOLATION.finditer(COMPOSE.read_text())}
    required = {m.group(1) for m in INTERPOLATION.finditer(COMPOSE.read_text()) if m.group(2) == ":?"}
    assert required <= example.keys() <= used
    assert ".env" in (REPO / ".gitignore").read_text().split(), "the real passwords must stay out of git"
    assert "guest" not in {u["name"] for u in _definitions()["users"]}


def test_the_tls_overlay_gives_every_service_amqps_and_its_certificates() -> None:
    overlay = _load(COMPOSE_TLS)
    services = overlay["services"]
    assert set(services) == {"rabbitmq", *FEDMQ_SERVICES}
    rabbitmq = {v.split(":")[1]: v.split(":")[0] for v in services["rabbitmq"]["volumes"]}
    assert (REPO / rabbitmq["/etc/rabbitmq/conf.d/20-fedmq-tls.conf"]).resolve() == TLS_CONF
    conf = dict(line.split(" = ", 1) for line in TLS_CONF.read_text().splitlines()
                if line and not line.startswith("#"))
    assert conf["listeners.ssl.default"] == "5671" and "5671:5671" in services["rabbitmq"]["ports"]
    assert (conf["ssl_options.verify"], conf["ssl_options.fail_if_no_peer_cert"]) == ("verify_peer", "true")
    for key in ("cacertfile", "certfile", "keyfile"):
        assert conf[f"ssl_options.{key}"].startswith("/etc/rabbitmq/tls/"), key
    for name in FEDMQ_SERVICES:
        service = services[name]
        env = _env(service)
        url = urlsplit(env["FEDMQ_BROKER_URL"])
        assert (url.scheme, url.hostname, url.port, url.username, url.password) == (
            "amqps", "rabbitmq", 5671, _user_of(name), None), name
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        for setting in ("FEDMQ_TLS_CA_FILE", "FEDMQ_TLS_CERT_FILE", "FEDMQ_TLS_KEY_FILE"):
            assert Path(env[setting]).parent.as_posix() in mounts, (name, setting)
            assert setting.removeprefix("FEDMQ_").lower() in Settings.model_fields
        assert "FEDMQ_TLS_VERIFY_HOSTNAME" not in env, "the broker's name is checked"


def _permissions() -> dict[str, dict[str, str]]:
    return {p["user"]: p for p in _definitions()["permissions"] if p["vhost"] == VHOST}


def _allowed(regex: str, resource: str) -> bool:
    # RabbitMQ matches permission regexes anywhere in the name (unanchored), like re.search.
    return re.search(regex, resource) is not None


class _RecordingChannel:
    """Stands in for a pika channel: records what declare_topology asks of the broker."""

    def __init__(self) -> None:
        self.exchanges: dict[str, str] = {}
        self.queues: dict[str, dict[str, Any]] = {}
        self.bindings: set[tuple[str, str, str]] = set()

    def exchange_declare(self, exchange: str, exchange_type: str = "direct", durable: bool = False) -> None:
        assert durable
        self.exchanges[exchange] = exchange_type

    def queue_declare(
        self, queue: str, durable: bool = False, arguments: dict[str, Any] | None = None
    ) -> None:
        assert durable
        self.queues[queue] = dict(arguments or {})

    def queue_bind(self, queue: str, exchange: str, routing_key: str | None = None) -> None:
        self.bindings.add((exchange, queue, queue if routing_key is None else routing_key))  # pika's default


def test_definitions_declare_exactly_the_topology_the_services_declare() -> None:
    """Pre-declared, so that no service creates a queue (creating one with a dead-letter exchange
    needs read on it and write on the DLX) and only the scheduler binds (binding a queue needs
    write on it); the arguments must be the services' own, or their declarations fail with 406
    PRECONDITION_FAILED."""
    ch = _RecordingChannel()
    topology.declare_topology(ch, Settings(_env_file=None))
    assert topology.bind_topology(ch)
    defs = _definitions()
    assert {e["name"]: e["type"] for e in defs["exchanges"]} == ch.exchanges
    assert {q["name"]: q["arguments"] for q in defs["queues"]} == ch.queues
    assert {(b["source"], b["destination"], b["routing_key"]) for b in defs["bindings"]} == ch.bindings
    for item in defs["exchanges"] + defs["queues"] + defs["bindings"]:
        assert item["vhost"] == VHOST
    for item in defs["exchanges"] + defs["queues"]:
        assert item["durable"] and not item["auto_delete"], item["name"]


# What the bus code does (common/bus/: topology.py, rabbitmq.py, consumers.py, blob.py),
# as (permission, resource) pairs.
BLOB = f"{blob.BLOB_PREFIX}{uuid.uuid4().hex}"
SERVER_NAMED = "amq.gen-JzTY20BRgKO-HjmUJj0wLg"
WORK_QUEUES = topology.QUEUES
WORK_EXCHANGES = tuple(topology.EXCHANGES.values())
ALL_EXCHANGES = (
    topology.EVENTS, topology.DLX, *WORK_EXCHANGES, topology.REPLIES, topology.BLOBS, topology.SITES,
)
SITE = topology.site_queue("hospital-a")
CONNECT = (
    # every declaration of the topology at every connect needs configure, existing or not
    *[("configure", name) for name in (*ALL_EXCHANGES, topology.DEAD_LETTERS, *WORK_QUEUES)],
    # the exclusive reply queue, bound to the reply exchange and consumed
    ("configure", SERVER_NAMED), ("write", SERVER_NAMED), ("read", SERVER_NAMED), ("read", topology.REPLIES),
    # dead letters go through the DLX
    ("write", topology.DLX),
    # large messages: declare a blob queue, bind it to the blob exchange, publish, read, delete
    ("configure", BLOB), ("write", BLOB), ("read", BLOB), ("read", topology.BLOBS), ("write", topology.BLOBS),
)
# The topology's owner binds every queue to its exchange (write on the queue, read on the exchange)
# and can create a missing queue with its x-dead-letter-exchange (read on it, write on the DLX).
OWNER = (
    *[("write", q) for q in (*WORK_QUEUES, topology.DEAD_LETTERS)],
    *[("read", x) for x in (*WORK_EXCHANGES, topology.DLX)],
    *[("read", q) for q in WORK_QUEUES],
)
# Where each service sends (the exchange in front of each destination queue; replies for the answerers).
SENDS = {
    "scheduler": (topology.AGGREGATOR, topology.TASKS),
    "aggregator": (topology.SCHEDULER,),
    "learner": (topology.SCHEDULER, topology.AGGREGATOR, topology.MODEL),
    "cli": (topology.SCHEDULER, topology.MODEL),
}
ANSWERS = ("scheduler", "aggregator")  # status requests, model and client-state requests
NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    # the scheduler declares (a new quorum queue with a dead-letter exchange needs read on it) and
    # binds a site's queue before its first task there, then sends to it
    "scheduler": (*CONNECT, *OWNER, ("read", topology.SCHEDULER), ("write", topology.EVENTS),
                  ("configure", SITE), ("write", SITE), ("read", SITE), ("read", topology.SITES),
                  ("write", topology.SITES)),
    "aggregator": (*CONNECT, ("read", topology.AGGREGATOR), ("read", topology.MODEL)),
    # a learner hosting a site declares its queue and consumes it (an operator narrows it per site)
    "learner": (*CONNECT, ("read", topology.TASKS), ("configure", SITE), ("read", SITE)),
    # `fedmq watch`: an exclusive queue bound to the events exchange
    "cli": (*CONNECT, ("read", topology.EVENTS)),
}
NEEDS = {
    user: (
        *needs, *[("write", topology.exchange_for(q)) for q in SENDS[user]],
        *((("write", topology.REPLIES),) if user in ANSWERS else ()),
    )
    for user, needs in NEEDS.items()
}
MUST_NOT: dict[str, tuple[tuple[str, str], ...]] = {
    user: (
        ("read", topology.DEAD_LETTERS),  # dead letters are for the operator
        ("configure", "fedmq.other"), ("configure", "other"), ("write", "amq.topic"), ("read", "other"),
        ("write", "amq.default"),  # it reaches every queue: nobody publishes through it
        ("configure", "amq.rabbitmq.reply-to"),
        # sending where the service does not send (the broker refuses it, whatever the body says)
        *[("write", topology.exchange_for(q)) for q in WORK_QUEUES if q not in SENDS[user]],
        *((("write", topology.REPLIES),) if user not in ANSWERS else ()),
        # binding a work queue (write on it) to an exchange one may write, or a queue of one's
        # own to a work exchange (read on it), would route around the exchanges' rights
        *(OWNER if user != "scheduler" else ()),
        *[("read", q) for q in WORK_QUEUES if ("read", q) not in NEEDS[user]],  # consuming others' work
        *((("write", topology.EVENTS),) if user != "scheduler" else ()),
        *((("read", topology.EVENTS),) if user != "cli" else ()),
        # a site's tasks: sent by the scheduler only, read by learners only, bound by neither else
        *((("write", topology.SITES), ("write", SITE), ("read", topology.SITES))
          if user != "scheduler" else ()),
        *((("read", SITE),) if user not in ("learner", "scheduler") else ()),
    )
    for user in SERVICE_USERS
}


@pytest.mark.parametrize("user", SERVICE_USERS)
def test_permissions_allow_what_the_service_does_and_no_more(user: str) -> None:
    perms = _permissions()[user]
    for kind, resource in NEEDS[user]:
        assert _allowed(perms[kind], resource), f"{user} lacks {kind} on {resource}"
    for kind, resource in MUST_NOT[user]:
        if (kind, resource) in NEEDS[user]:
            continue  # the aggregator and the learner read their own work queue
        assert not _allowed(perms[kind], resource), f"{user} should not have {kind} on {resource}"


def _conf() -> dict[str, str]:
    pairs = {}
    for line in RABBITMQ_CONF.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def test_rabbitmq_conf_outlasts_local_training_and_loads_the_definitions() -> None:
    conf = _conf()
    # A learner holds its task unacked while it trains: the timeout must outlast the longest
    # training the metrics were sized for (the train-time histogram's last bucket), and the default.
    assert int(conf["consumer_timeout"]) > max(DURATION_BUCKETS) * 1000
    assert int(conf["consumer_timeout"]) > 30 * 60 * 1000
    assert conf["load_definitions"] == "/etc/rabbitmq/definitions.json"
    frame = Settings.model_fields["frame_bytes"].default
    assert 2 * frame <= int(conf["max_message_size"]) <= 512 * 1024 * 1024
    plugins = ENABLED_PLUGINS.read_text().strip()
    assert re.fullmatch(r"\[\s*[a-z_]+(\s*,\s*[a-z_]+)*\s*\]\s*\.", plugins), plugins
    assert {"rabbitmq_management", "rabbitmq_prometheus"} <= set(re.findall(r"[a-z_]+", plugins))


# -- Prometheus and Grafana -------------------------------------------------------------------------


def test_promtool_checks_the_prometheus_config() -> None:
    promtool = _tool("promtool", "prometheus")
    proc = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheus_scrapes_every_service() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["scheduler"]["static_configs"][0]["targets"] == ["scheduler:9100"]
    assert jobs["aggregator"]["static_configs"][0]["targets"] == ["aggregator:9100"]
    # Scaled learners are found by DNS: one A record per replica of the compose service.
    learners = [sd for j in jobs.values() for sd in j.get("dns_sd_configs", [])]
    names = {n for sd in learners for n in sd["names"]}
    assert names == {"learner", "learner-gpu0", "learner-gpu1"}
    assert all(sd["type"] == "A" and sd["port"] == 9100 for sd in learners)
    assert jobs["rabbitmq"]["static_configs"][0]["targets"] == ["rabbitmq:15692"]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for _, t in _targets(dashboard)]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_grafana_provisions_the_datasource_the_dashboard_uses() -> None:
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert (source["uid"], source["type"]) == (DATASOURCE_UID, "prometheus")
    assert urlsplit(source["url"]).hostname == "prometheus"


def test_dashboard_is_a_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["title"] and dashboard["uid"]
    assert "id" not in dashboard or dashboard["id"] is None, "provisioned dashboards carry no database id"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        assert panel["type"] in {"timeseries", "stat", "gauge", "bargauge", "table", "row"}
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what the panel means"
    for panel, target in _targets(dashboard):
        assert target.get("datasource", panel["datasource"])["uid"] == DATASOURCE_UID
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "fl_job"
    assert variable["datasource"]["uid"] == DATASOURCE_UID
    assert variable["definition"] == "label_values(fedmq_job_round, fl_job)"
    assert variable["query"]["query"] == variable["definition"]


def test_dashboard_has_the_panels_the_deployment_promises(dashboard: dict[str, Any]) -> None:
    exprs = "\n".join(_exprs(dashboard))
    for needed in (
        'fedmq_round_metric{fl_job=~"$fl_job", source=~"server|federated"}',
        'fedmq_round_metric{fl_job=~"$fl_job", source=~"train|strategy"}',
        "fedmq_job_round", "rate(fedmq_rounds_completed_total",
        "histogram_quantile(0.9, sum by (le) (rate(fedmq_round_duration_seconds_bucket",
        "fedmq_updates_accepted_total", "sum by (reason) (rate(fedmq_updates_rejected_total",
        "fedmq_learners_alive", "fedmq_learners_busy", "fedmq_tasks_in_flight",
        "fedmq_learner_train_seconds_bucket", "fedmq_bus_published_bytes_total",
        "fedmq_bus_consumed_bytes_total", "fedmq_messages_rejected_total", "by (code)",
    ):
        assert needed in exprs, needed


def _registered_metric_names() -> set[str]:
    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        if family.type == "counter":  # prometheus_client drops _total from counter family names
            names.add(f"{family.name}_total")
    return names


def test_dashboard_uses_only_metrics_fedmq_exports(dashboard: dict[str, Any]) -> None:
    registered = _registered_metric_names()
    used = {HISTOGRAM_SUFFIX.sub("", name) for e in _exprs(dashboard) for name in METRIC_NAME.findall(e)}
    assert used, "no fedmq metric in the dashboard"
    unknown = sorted(used - registered)
    assert not unknown, f"not in common/metrics.py: {unknown}"
    # Histogram series only on histograms, and counters only through rate() or increase().
    kinds = {f.name: f.type for f in Metrics().registry.collect()}
    for expr in _exprs(dashboard):
        for name in METRIC_NAME.findall(expr):
            if HISTOGRAM_SUFFIX.search(name):
                assert kinds.get(HISTOGRAM_SUFFIX.sub("", name)) == "histogram", name


def _concrete(expr: str) -> str:
    """A dashboard query as Prometheus would receive it from Grafana."""
    for variable, value in {
        "$__rate_interval": "20s", "$__interval": "5s", "$__range": "1h", '"$fl_job"': '".*"',
    }.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def test_every_dashboard_query_parses_as_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    promtool = _tool("promtool", "prometheus")
    exprs = [t["expr"] for _, t in _targets(dashboard)]
    rules = {"groups": [{"name": "fedmq_dashboard", "rules": [
        {"record": f"fedmq:check_{i}", "expr": _concrete(expr)} for i, expr in enumerate(exprs)
    ]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in proc.stdout + proc.stderr


# -- the image ----------------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_installs_torch_first_and_runs_as_fedmq() -> None:
    steps = _instructions()
    assert steps[0][0] == "ARG" and "BASE_IMAGE=python:3.11-slim" in steps[0][1]
    assert [s for s in steps if s[0] == "FROM"] == [("FROM", "${BASE_IMAGE}")]
    args = dict(s[1].split("=", 1) for s in steps if s[0] == "ARG" and "=" in s[1])
    assert args["TORCH_SPEC"] == "torch==2.13.0"
    assert args["TORCH_INDEX_URL"] in ('""', ""), "the builder chooses the torch index"
    runs = [s[1] for s in steps if s[0] == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if "${TORCH_SPEC}" in r)
    project = re.compile(r"pip install \"?(/tmp/fedmq-src|\.)(\[console\])?\"?( |;|$)")  # the console's extra
    project_step = next(i for i, r in enumerate(runs) if project.search(r))
    assert torch_step < project_step, "torch must be installed before the project"
    assert any("--index-url" in r and "${TORCH_INDEX_URL}" in r for r in runs)
    assert any(s[0] == "COPY" and "examples" in s[1] for s in steps)
    users = [s[1] for s in steps if s[0] == "USER"]
    assert users, "the image must not run as root"
    final_user = users[-1].split(":")[0].replace("${FEDMQ_UID}", args.get("FEDMQ_UID", ""))
    assert final_user not in {"root", "0", ""}
    assert final_user in {"fedmq", args.get("FEDMQ_UID")}
    assert any("useradd" in r and "fedmq" in r for r in runs)
    assert any("chown fedmq" in r and "/var/lib/fedmq" in r for r in runs)
    assert ("ENTRYPOINT", '["fedmq"]') in steps


def test_dockerignore_keeps_the_venv_run_state_and_secrets_out_and_what_the_image_copies_in() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", ".fedmq", ".env", "deploy/tls"} <= patterns
    copied = [src for word, rest in _instructions() if word == "COPY" for src in rest.split()[:-1]]
    assert copied, "the Dockerfile copies the project in"
    for src in copied:
        assert not any(fnmatch.fnmatch(src, p) for p in patterns), f".dockerignore drops {src}"


def test_no_package_registry_host_is_written_into_the_deployment() -> None:
    files = [COMPOSE, *(p for p in DEPLOY.rglob("*") if p.is_file())]
    for path in files:
        text = path.read_text(errors="replace").lower()
        for host in ("pypi.org", "download.pytorch.org", "files.pythonhosted", "pythonhosted.org"):
            assert host not in text, f"{path.relative_to(REPO)} names {host}"


# -- the definitions on a real broker -------------------------------------------------------------------


TINY_JOB = """\
name: deploy-permissions
seed: 1
model: {name: mlp, hidden: [512]}
data: {name: digits, partition: {kind: iid}}
clients: {total: 3}
rounds: 2
train: {epochs: 1, batch_size: 64, lr: 0.1}
round_timeout_s: 120
"""


@pytest.mark.rabbitmq
@pytest.mark.rabbitmq
@pytest.mark.slow
def test_services_run_a_job_as_their_own_users(tmp_path: Path) -> None:
    """definitions.json on a live broker: each service as its own user runs a job end to end.

    The users, the vhost and the topology are imported under unique names and deleted afterwards.
    A frame size below the model's size makes models and updates travel as blobs, so the blob
    permissions are exercised too; operations outside each user's rights must be refused.
    """
    import pika
    import pika.exceptions

    from tests.e2e.cluster import Cluster
    from tests.rabbit import deployed_vhost

    with deployed_vhost() as deployed:
        url = deployed.url
        c = Cluster(url("cli"), tmp_path, {"FEDMQ_FRAME_BYTES": "65536", **deployed.role_env()})
        try:
            for service in ("scheduler", "aggregator", "learner"):
                c.start(service, FEDMQ_BROKER_URL=url(service))
            c.wait_learners(1, timeout=90)
            spec = tmp_path / "job.yaml"
            spec.write_text(TINY_JOB)
            done = c.fedmq("submit", str(spec), "--watch", timeout=240)
            logs = "\n".join(c.log(s)[-2000:] for s in ("scheduler", "aggregator", "learner"))
            assert done.returncode == 0, done.stdout + done.stderr + logs
            for service in ("scheduler", "aggregator", "learner"):
                assert "ACCESS_REFUSED" not in c.log(service), c.log(service)[-3000:]
            assert c.stop_all() == {name: 0 for name in c.procs}
            # Models (aggregator) and updates (learner) travelled as blobs, under the blob permissions.
            for service in ("aggregator", "learner"):
                stats = [json.loads(line) for line in c.log(service).splitlines() if '"bus_stats"' in line]
                assert stats and stats[-1]["blobs_sent"] > 0, c.log(service)[-2000:]
        finally:
            c.close()
            for proc in c.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)

        refused = [
            ("learner", lambda ch: ch.basic_get(topology.DEAD_LETTERS)),
            ("learner", lambda ch: ch.basic_get(topology.AGGREGATOR)),
            ("aggregator", lambda ch: ch.basic_get(topology.TASKS)),
            ("learner", lambda ch: ch.exchange_declare("fedmq.other", exchange_type="topic")),
            ("aggregator", lambda ch: ch.queue_declare("fedmq.other")),
            ("cli", lambda ch: ch.basic_get(topology.DEAD_LETTERS)),
            ("scheduler", lambda ch: ch.queue_bind(topology.TASKS, topology.EVENTS, routing_key="#")),
        ]
        for user, operation in refused:
            conn = pika.BlockingConnection(pika.URLParameters(url(user)))
            try:
                with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
                    operation(conn.channel())
                assert info.value.reply_code == 403, (user, info.value)
            finally:
                conn.close()

