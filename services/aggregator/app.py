"""Wiring of the aggregator process: its service on RabbitMQ with metrics, served until a signal."""

from __future__ import annotations

from fedmq.common.lifecycle import run_service
from fedmq.common.settings import Settings
from fedmq.services.aggregator.service import AggregatorService


def main(settings: Settings) -> None:
    run_service("aggregator", settings, AggregatorService, uses_torch=True)
