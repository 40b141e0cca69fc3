"""Wiring of the scheduler process: its service on RabbitMQ with metrics, served until a signal."""

from __future__ import annotations

from fedmq.common.lifecycle import run_service
from fedmq.common.settings import Settings
from fedmq.services.scheduler.service import SchedulerService


def main(settings: Settings) -> None:
    run_service("scheduler", settings, SchedulerService)  # control plane: torch is never imported
