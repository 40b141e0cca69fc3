"""Service settings from the environment (prefix FEDMQ_) and an optional .env file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class Settings(BaseSettings):
    """Everything a fedmq service reads from its environment; built once at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="FEDMQ_", env_file=".env", extra="ignore", frozen=True
    )

    broker_url: str = Field(
        "amqp://guest:guest@127.0.0.1:5672/%2F", description="AMQP URL of RabbitMQ (amqp or amqps)"
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
    retry_initial_s: float = Field(0.5, gt=0, description="first reconnect backoff")
    retry_max_s: float = Field(30.0, gt=0, description="reconnect backoff cap")
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
        if urlsplit(value).scheme not in {"amqp", "amqps"}:
            raise ValueError("must start with amqp:// or amqps://")
        return value

    @property
    def safe_broker_url(self) -> str:
        """The broker URL with the password hidden, fit for logs and error messages."""
        return redact_url(self.broker_url)


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))
