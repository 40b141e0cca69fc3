"""Wiring of the scheduler process: settings in, bus and service built, served until a signal."""

from __future__ import annotations

from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.lifecycle import serve
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.services.scheduler.service import SchedulerService


def main(settings: Settings) -> None:
    bus = RabbitBus(settings, name="scheduler")
    metrics = Metrics()
    bus.on_traffic = metrics.traffic
    bus.on_dead_letter = metrics.dead_letter
    metrics.serve(settings.metrics_port)
    serve(SchedulerService(settings, bus, metrics), bus, "scheduler")
