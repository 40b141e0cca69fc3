"""Service settings from the environment (prefix FEDMQ_) and an optional .env file."""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fedmq.common.allowlist import parse_prefixes
from fedmq.common.errors import ConfigError
from fedmq.common.messages import PUSHED_MODEL_MAX, TASK_BATCH_MAX
from fedmq.common.sites import SITE_NAME
from fedmq.common.tls import client_context

MiB = 1024 * 1024

MEMORY_URL = "memory://"  # FEDMQ_BROKER_URL for the in-memory broker of one process

# A comma starts the next address only where a URL scheme follows: a comma inside one URL
# (a password, a query) stays in it.
_NEXT_URL = re.compile(r"\s*,\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")


class Settings(BaseSettings):
    """Everything a fedmq service reads from its environment; built once at start-up."""

    # hide_input_in_errors: a rejected value (a URL with its password) never reaches an error message.
    model_config = SettingsConfigDict(
        env_prefix="FEDMQ_", env_file=".env", extra="ignore", frozen=True, hide_input_in_errors=True
    )

    broker_url: str = Field(
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        description="AMQP URL of RabbitMQ (amqp or amqps); for a cluster, one URL per node, "
        "comma-separated: a lost connection moves to the next. Leave the password out of it "
        "(amqp://user@host/vhost) and give it in FEDMQ_BROKER_PASSWORD_FILE. memory:// is one "
        "process's in-memory broker (common/bus/factory.py): only for all services in one process",
        repr=False,  # __repr_args__ shows it with the password hidden
    )
    broker_password: SecretStr | None = Field(
        None, description="the broker password for a URL that names a user and no password; "
        "prefer FEDMQ_BROKER_PASSWORD_FILE",
    )
    broker_password_file: Path | None = Field(
        None, description="a file holding the broker password (a Docker or Kubernetes secret), "
        "read at every connect; for a URL that names a user and no password",
    )
    tls_ca_file: Path | None = Field(
        None, description="amqps: PEM CA certificate(s) that signed the broker's certificate; "
        "unset: the system's CAs",
    )
    tls_cert_file: Path | None = Field(
        None, description="amqps: PEM client certificate, for a broker that verifies its peers",
    )
    tls_key_file: Path | None = Field(
        None, description="amqps: the client certificate's unencrypted PEM private key",
    )
    tls_verify_hostname: bool = Field(
        True, description="amqps: check that the broker's certificate names the URL's host",
    )
    state_dir: Path = Field(Path(".fedmq"), description="where jobs, checkpoints and updates persist")
    fsync: bool = Field(
        True, description="fsync state before acking; false (fedmq run's choice) survives a killed "
        "process but not a power loss",
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 disables")
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: console on a TTY, JSON otherwise"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    node: str = Field("", description="node name for rank assignment; defaults to the hostname")
    master_node: str = Field("", description="node that takes rank 0; defaults to the first by name")
    replica: int | None = Field(
        None, ge=0, description="learner replica index: picks its GPU and names it; unset: named by pid"
    )
    frame_bytes: int = Field(4 * MiB, ge=64 * 1024, description="largest single broker message")
    max_message_bytes: int = Field(2048 * MiB, gt=0, description="largest reassembled message")
    blob_expiry_s: int = Field(
        600, ge=1, le=4_294_967,
        description="a large message's chunk queue unused this long is deleted (a sender that died); "
        "keep it above the longest wait of a message in its queue",
    )
    blob_commit_bytes: int = Field(
        16 * MiB, ge=1, description="a large message's chunks sent per transaction (the broker holds "
        "them in memory until the commit, then persists them)",
    )
    delivery_limit: int = Field(20, ge=1, description="deliveries of one message before it is dead-lettered")
    # fedmq.dead is bounded three ways; past any bound the oldest dead letters are dropped.
    dead_letter_max_count: int = Field(
        10_000, ge=1, description="dead letters fedmq.dead keeps; beyond, the oldest are dropped"
    )
    dead_letter_max_bytes: int = Field(
        64 * MiB, ge=1, description="bytes of bodies fedmq.dead keeps; beyond, the oldest are dropped"
    )
    dead_letter_ttl_s: int = Field(
        7 * 24 * 3600, ge=1, le=4_294_967, description="seconds a dead letter is kept (at most ~49 days)"
    )
    dead_letter_body_bytes: int = Field(
        64 * 1024, ge=0,
        description="largest body a dead letter keeps; a larger one is dropped, its reason and size kept",
    )
    liveness_s: float = Field(5.0, gt=0, description="how often learners report to the scheduler")
    heartbeat_s: int = Field(30, ge=1, description="AMQP heartbeat")
    request_timeout_s: float = Field(120.0, gt=0, description="model fetch and publish timeout")
    retry_initial_s: float = Field(0.5, gt=0, description="first reconnect (or state write retry) backoff")
    retry_max_s: float = Field(30.0, gt=0, description="reconnect backoff cap")
    state_retry_max_s: float = Field(
        5.0, gt=0, description="longest wait before retrying a state write that failed (disk full)"
    )
    job_start_timeout_s: float = Field(
        300.0, gt=0, description="a job whose first round has not started by then fails (scheduler)"
    )
    data_dir: Path | None = Field(
        None, description="a learner's own data folder, handed to the Task's load_data (files only here)"
    )
    sites: str = Field(
        "", description="sites this learner hosts, comma-separated (e.g. `hospital-a,hospital-b`): it takes "
        "those sites' tasks only, and its FEDMQ_DATA_DIR holds their data; empty: any logical client's",
    )
    site_users: str = Field(
        "", description="which broker users serve each site, as `site:user` pairs, comma-separated "
        "(aggregator, scheduler): a site listed here takes updates, evaluations and failures from those "
        "users only; a site not listed, from any learner user",
    )
    data_cache_clients: int = Field(
        64, ge=1, description="clients whose data a learner keeps loaded at once (least recently used goes); "
        "at least fuse_clients"
    )
    shared_models_dir: Path | None = Field(
        None, description="learners: a folder the learners of one host share (a compose volume): a global "
        "model one of them fetched in chunks is linked there and the others read it from there, checked "
        "against its digest, instead of fetching it again over the broker. Writable by those learners only, "
        "as their state_dir is; unset: each learner fetches its own",
    )
    push_model_bytes: int = Field(
        1024**2, ge=0, le=PUSHED_MODEL_MAX, description="aggregator: a global model of at most this many "
        "bytes goes to the learners with the round's tasks (through the scheduler), checked against its "
        "digest there, instead of each learner fetching it (up to half of FEDMQ_FRAME_BYTES, and in at "
        "most 64 messages of a round); larger models, and those a job sends rounded "
        "(compression.downlink), are fetched. 0: always fetched",
    )
    task_batch: int = Field(
        64, ge=1, le=TASK_BATCH_MAX, description="scheduler: the most training tasks of a round it sends "
        "in one message. A round's tasks for a queue go as one message per learner serving it (its share, "
        "up to this), so a learner takes its share at once (a fused job's updates then go back as one "
        "message); 1: one message a task, as learners older than these batches read (with "
        "FEDMQ_PUSH_MODEL_BYTES=0 on the aggregator)",
    )
    aggregator_closes_rounds: bool = Field(
        True, description="scheduler: a round's RoundOpen lets the aggregator close the round itself the "
        "moment every sampled client's update is stored (the RoundClose the scheduler would send, one "
        "broker hop sooner; closes at the deadline stay the scheduler's). false: the scheduler always "
        "sends the RoundClose, as aggregators older than this setting need",
    )
    fuse_clients: int | None = Field(
        None, ge=1, description="the most clients a learner trains together in one fused group (of the share "
        "of a round the scheduler sends it in one message), for jobs that fuse (train.fuse not false), and "
        "fewer where fuse_memory_bytes holds fewer; 1: each client alone (through the fused kernel, as a "
        "group of two). Unset: 64 on a CPU (a client's bits do not depend on its group there), 1 on a GPU "
        "(its batched kernels may change the last bits with the group's size). `fedmq run`: its share of "
        "a round's clients",
    )
    dp_key: SecretStr | None = Field(
        None, description="learners: the secret that seeds train.dp_sgd's noise and batch order; give every "
        "learner the same and never the scheduler or aggregator (whoever holds it can take the noise out). "
        "Unset: a random key per learner process (DP runs do not repeat bit for bit)",
    )
    state_key: SecretStr | None = Field(
        None, description="learners: the secret that seals each client's state (personal models, kept "
        "optimizer state, a Task's ctx.state) before it goes to the aggregator to be kept; give every "
        "learner the same and never the scheduler or aggregator. Unset: it travels and is kept unsealed",
    )
    state_cache_bytes: int = Field(
        256 * 1024**2, ge=0, description="learners: memory for the state of the clients this learner "
        "trained, reused when the scheduler sends a client back to it (no fetch from the aggregator, "
        "which keeps the durable copy); the least recently used spill to disk",
    )
    state_cache_disk_bytes: int = Field(
        2 * 1024**3, ge=0, description="learners: disk under FEDMQ_STATE_DIR for client state spilled "
        "from memory (sealed with FEDMQ_STATE_KEY where set); past it the oldest go, to be fetched again",
    )
    fuse_memory_bytes: int = Field(
        0, ge=0, description="memory one fused group may use (weights, gradients, optimizer state per "
        "client); 0: a quarter of the device's free memory (the host's available memory on CPU)",
    )
    allowed_code: str = Field(
        "",
        description="module prefixes, comma-separated, a job spec may name code (Task, strategy) from "
        "besides fedmq's built-ins: `acme` allows acme and acme.x, not acmeevil; anything else is "
        "refused before it is imported (`fedmq run` also allows your project: see Security)",
    )
    # Per-deployment limits on what one submission may ask for (the scheduler refuses the job,
    # naming the setting), and on what one job may take of the aggregator (it fails the job).
    max_clients: int = Field(100_000, ge=1, description="largest clients.total a job may have (scheduler)")
    max_rounds: int = Field(10_000, ge=1, description="largest rounds a job may have (scheduler)")
    max_jobs: int = Field(
        16, ge=1, description="jobs running at once; a submission beyond is refused (scheduler)"
    )
    max_model_bytes: int = Field(
        1024 * MiB, ge=1, description="largest global model (its tensors' bytes); a job with a larger one "
        "fails when the aggregator builds it",
    )
    job_disk_bytes: int = Field(
        20 * 1024 * MiB, ge=1, description="disk one job's aggregator state may use (updates, checkpoints, "
        "client state); a write beyond fails the job (the engine's job folder too, checked at each "
        "checkpoint)",
    )
    keep_checkpoints: int = Field(
        0, ge=0, description="global checkpoints the aggregator keeps per job: the last N rounds' and the "
        "best round's (older pruned); 0 keeps every round's",
    )
    checkpoint_every: int = Field(
        10, ge=1, description="`fedmq run`: rounds between the engine's checkpoints (the last round's is "
        "always written); --resume goes on from the newest",
    )
    torch_threads: int = Field(
        0, ge=0, description="torch threads; 0: one per service process and in `fedmq run`'s engine (the "
        "same count gives the same bits on CPU), a share of the cores in `fedmq run --services`"
    )
    scheduler_users: str = Field(
        "scheduler,guest", description="broker users (comma-separated) whose job, round and task "
        "messages are taken; `guest` is all-powerful where it exists (a broker with no definitions)",
    )
    aggregator_users: str = Field(
        "aggregator,guest", description="broker users whose update receipts and round results are taken",
    )
    learner_users: str = Field(
        "learner,guest",
        description="broker users whose updates, evaluations, failures and heartbeats are taken",
    )
    console_host: str = Field(
        "127.0.0.1", description="`fedmq console`: the address it listens on; 0.0.0.0 only behind a proxy "
        "that adds TLS, or in a container whose port is published to 127.0.0.1",
    )
    console_port: int = Field(8080, gt=0, lt=65536, description="`fedmq console`: its HTTP port")
    console_allowed_hosts: str = Field(
        "localhost,127.0.0.1,::1", description="`fedmq console`: the host names its pages may be asked "
        "for by (the Host header), comma-separated, besides FEDMQ_CONSOLE_HOST; `*`: any. Keeps a web "
        "page elsewhere from reaching it through a browser by DNS rebinding. Behind a proxy: its name",
    )
    console_secure_cookie: bool = Field(
        False, description="`fedmq console`: mark its session cookie Secure (browsers then send it over "
        "HTTPS only); set it behind a proxy that adds TLS",
    )
    console_token: SecretStr | None = Field(
        None, description="`fedmq console`: the token that logs in (at least 16 characters); prefer "
        "FEDMQ_CONSOLE_TOKEN_FILE. The console refuses to start without one",
    )
    console_token_file: Path | None = Field(
        None, description="`fedmq console`: a file holding its login token (a Docker or Kubernetes secret)",
    )
    cli_users: str = Field(
        "cli,guest", description="broker users whose job submissions, cancels and status requests are taken",
    )

    @field_validator("dp_key", "state_key", "console_token")
    @classmethod
    def _secret(cls, value: SecretStr | None) -> SecretStr | None:
        """An empty key (compose's `${LEARNER_DP_KEY:-}` left unset) is no key."""
        return value if value is not None and value.get_secret_value() else None

    @field_validator("state_key")
    @classmethod
    def _state_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("FEDMQ_STATE_KEY must be at least 16 characters: a long random string")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        value = value.strip().lower()
        if value in {"auto", "cpu", "cuda"}:
            return value
        if value.startswith("cuda:") and value[5:].isdigit():
            return value
        raise ValueError("must be auto, cpu, cuda or cuda:N")

    @field_validator("allowed_code")
    @classmethod
    def _allowed_code(cls, value: str) -> str:
        return ",".join(parse_prefixes(value))

    @field_validator("sites")
    @classmethod
    def _sites(cls, value: str) -> str:
        return ",".join(_site_names(value.split(",")))

    @field_validator("site_users")
    @classmethod
    def _site_users(cls, value: str) -> str:
        pairs = [pair.strip() for pair in value.split(",") if pair.strip()]
        for pair in pairs:
            site, _, user = pair.partition(":")
            if not user.strip():
                raise ValueError(f"{pair!r}: write each pair as site:user, e.g. hospital-a:learner-a")
            _site_names([site])
        return ",".join(pairs)

    @field_validator("broker_url")
    @classmethod
    def _url(cls, value: str) -> str:
        urls = split_urls(value)
        if not urls:
            raise ValueError("must name at least one broker: amqp://user:password@host:port/vhost")
        if MEMORY_URL in urls:
            if len(urls) > 1:
                raise ValueError(f"{MEMORY_URL} is this process's own broker: it stands alone, not in a list")
            return MEMORY_URL
        for url in urls:
            if urlsplit(url).scheme not in {"amqp", "amqps"}:
                raise ValueError(
                    f"{redact_url(url)}: must start with amqp:// or amqps:// (or be {MEMORY_URL})")
        return ",".join(urls)

    @model_validator(mode="after")
    def _credentials_and_tls(self) -> Settings:
        try:
            check_credentials(self)
            if any(urlsplit(url).scheme == "amqps" for url in self.broker_urls):
                self.tls_context()  # every file is read and checked now, not at the first connect
            elif self.tls_ca_file or self.tls_cert_file or self.tls_key_file:
                if self.in_memory:
                    raise ConfigError("FEDMQ_TLS_* files are set but FEDMQ_BROKER_URL is memory://, "
                                      "which no connection reaches: unset them")
                raise ConfigError(
                    "FEDMQ_TLS_* files are set but FEDMQ_BROKER_URL is amqp://: use amqps:// "
                    "(RabbitMQ's TLS port, 5671 by default)"
                )
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        yield ("broker_url", self.safe_broker_url)
        yield from super().__repr_args__()

    def tls_context(self) -> ssl.SSLContext:
        """The client context for amqps URLs; ConfigError naming a missing or invalid file."""
        return client_context(
            self.tls_ca_file, self.tls_cert_file, self.tls_key_file, verify_hostname=self.tls_verify_hostname
        )

    def console_token_value(self) -> str:
        """The console's login token, from FEDMQ_CONSOLE_TOKEN_FILE (read now) or FEDMQ_CONSOLE_TOKEN;
        ConfigError saying what to set when there is none or it is short."""
        if self.console_token_file is not None and self.console_token is not None:
            raise ConfigError("FEDMQ_CONSOLE_TOKEN and FEDMQ_CONSOLE_TOKEN_FILE are both set: keep one")
        if self.console_token_file is not None:
            token = read_password_file(self.console_token_file, "FEDMQ_CONSOLE_TOKEN_FILE")
        elif self.console_token is not None:
            token = self.console_token.get_secret_value()
        else:
            raise ConfigError(
                "the console needs a login token and has no default one: set FEDMQ_CONSOLE_TOKEN_FILE to a "
                "file holding a long random string (e.g. `python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))' > console.token`), or FEDMQ_CONSOLE_TOKEN"
            )
        if len(token) < 16:
            raise ConfigError("the console's token must be at least 16 characters: a long random string")
        return token

    def broker_password_value(self) -> str | None:
        """The password of FEDMQ_BROKER_PASSWORD_FILE (read now) or FEDMQ_BROKER_PASSWORD; None: neither."""
        if self.broker_password_file is not None:
            return read_password_file(self.broker_password_file)
        if self.broker_password is not None:
            return self.broker_password.get_secret_value()
        return None

    @property
    def role_users(self) -> dict[str, frozenset[str]]:
        """Each sender role (scheduler, aggregator, learner, cli) and the broker users that hold it."""
        lists = {
            "scheduler": self.scheduler_users, "aggregator": self.aggregator_users,
            "learner": self.learner_users, "cli": self.cli_users,
        }
        return {role: frozenset(filter(None, map(str.strip, u.split(",")))) for role, u in lists.items()}

    @property
    def site_names(self) -> tuple[str, ...]:
        """The sites this learner hosts (FEDMQ_SITES); empty: it serves logical clients."""
        return tuple(filter(None, self.sites.split(",")))

    @property
    def users_of_sites(self) -> dict[str, frozenset[str]]:
        """FEDMQ_SITE_USERS as site → the broker users that serve it."""
        users: dict[str, set[str]] = {}
        for pair in filter(None, self.site_users.split(",")):
            site, _, user = pair.partition(":")
            users.setdefault(site.strip(), set()).add(user.strip())
        return {site: frozenset(names) for site, names in users.items()}

    @property
    def broker_urls(self) -> tuple[str, ...]:
        """Every broker address, in the order a service tries them."""
        return split_urls(self.broker_url)

    @property
    def allowed_prefixes(self) -> tuple[str, ...]:
        """The operator's module prefixes (fedmq's built-ins are always allowed besides)."""
        return parse_prefixes(self.allowed_code)

    @property
    def in_memory(self) -> bool:
        """Whether the broker is this process's own, in memory (FEDMQ_BROKER_URL=memory://)."""
        return self.broker_url == MEMORY_URL

    @property
    def safe_broker_url(self) -> str:
        """The broker URLs with their passwords hidden, fit for logs and error messages."""
        return ", ".join(redact_url(url) for url in self.broker_urls)


def _site_names(names: list[str]) -> list[str]:
    cleaned = [name.strip() for name in names if name.strip()]
    for name in cleaned:
        if not SITE_NAME.match(name):
            raise ValueError(f"{name!r} is not a site name: letters, digits, '-' and '_', at most 64")
    return list(dict.fromkeys(cleaned))


def split_urls(value: str) -> tuple[str, ...]:
    """`amqp://a/vh, amqp://b/vh` -> both URLs; one URL -> itself."""
    return tuple(url for url in _NEXT_URL.split(value.strip()) if url)


def redact_url(url: str) -> str:
    """One URL with its password replaced by ***, however malformed the rest of it."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def read_password_file(path: Path, setting: str = "FEDMQ_BROKER_PASSWORD_FILE") -> str:
    """The password in a file, without its trailing newline; ConfigError (never the content) if unusable."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{setting}={path}: cannot read it ({why})") from None
    password = text.rstrip("\r\n")
    if not password:
        raise ConfigError(f"{setting}={path}: the file is empty")
    return password


def check_credentials(settings: Settings) -> None:
    """The password is given once, where a user is named: in the URL or in a setting, not both."""
    if settings.broker_password is not None and settings.broker_password_file is not None:
        raise ConfigError("set FEDMQ_BROKER_PASSWORD_FILE or FEDMQ_BROKER_PASSWORD, not both")
    from_setting = settings.broker_password is not None or settings.broker_password_file is not None
    if from_setting and settings.in_memory:
        raise ConfigError("FEDMQ_BROKER_PASSWORD* is set but FEDMQ_BROKER_URL is memory://, where no one "
                          "logs in: unset the password, or give the broker's amqp:// URL")
    for url in settings.broker_urls:
        parts = urlsplit(url)
        if parts.password is not None and from_setting:
            raise ConfigError(
                f"{redact_url(url)} has a password and a FEDMQ_BROKER_PASSWORD* setting gives another: "
                "take it out of FEDMQ_BROKER_URL"
            )
        if parts.username is None and from_setting:
            raise ConfigError(
                f"{url}: FEDMQ_BROKER_PASSWORD* is set but the URL names no user (amqp://USER@host/vhost)"
            )
        if parts.username is not None and parts.password is None and not from_setting:
            raise ConfigError(
                f"{url} names user {parts.username!r} but no password: set FEDMQ_BROKER_PASSWORD_FILE "
                "(or FEDMQ_BROKER_PASSWORD)"
            )
    if settings.broker_password_file is not None:
        read_password_file(settings.broker_password_file)
