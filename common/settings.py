"""Service settings from the environment (prefix FEDMQ_) and an optional .env file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024

# A comma starts the next address only where a URL scheme follows: a comma inside one URL
# (a password, a query) stays in it.
_NEXT_URL = re.compile(r"\s*,\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")


class Settings(BaseSettings):
    """Everything a fedmq service reads from its environment; built once at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="FEDMQ_", env_file=".env", extra="ignore", frozen=True
    )

    broker_url: str = Field(
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        description="AMQP URL of RabbitMQ (amqp or amqps); for a cluster, one URL per node, "
        "comma-separated: a lost connection moves to the next",
    )
    state_dir: Path = Field(Path(".fedmq"), description="where jobs, checkpoints and updates persist")
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
    data_cache_clients: int = Field(
        64, ge=1, description="clients whose data a learner keeps loaded at once (least recently used goes)"
    )
    torch_threads: int = Field(
        0, ge=0, description="torch threads; 0: one per service process, a share of the cores in `fedmq run`"
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        value = value.strip().lower()
        if value in {"auto", "cpu", "cuda"}:
            return value
        if value.startswith("cuda:") and value[5:].isdigit():
            return value
        raise ValueError("must be auto, cpu, cuda or cuda:N")

    @field_validator("broker_url")
    @classmethod
    def _url(cls, value: str) -> str:
        urls = split_urls(value)
        if not urls:
            raise ValueError("must name at least one broker: amqp://user:password@host:port/vhost")
        for url in urls:
            if urlsplit(url).scheme not in {"amqp", "amqps"}:
                raise ValueError(f"{redact_url(url)}: must start with amqp:// or amqps://")
        return ",".join(urls)

    @property
    def broker_urls(self) -> tuple[str, ...]:
        """Every broker address, in the order a service tries them."""
        return split_urls(self.broker_url)

    @property
    def safe_broker_url(self) -> str:
        """The broker URLs with their passwords hidden, fit for logs and error messages."""
        return ", ".join(redact_url(url) for url in self.broker_urls)


def split_urls(value: str) -> tuple[str, ...]:
    """`amqp://a/vh, amqp://b/vh` -> both URLs; one URL -> itself."""
    return tuple(url for url in _NEXT_URL.split(value.strip()) if url)


def redact_url(url: str) -> str:
    """One URL with its password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))
