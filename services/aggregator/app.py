"""Wiring of the aggregator process: settings in, bus and service built, served until a signal."""

from __future__ import annotations

from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.lifecycle import limit_torch_threads, serve
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.services.aggregator.service import AggregatorService


def main(settings: Settings) -> None:
    limit_torch_threads(settings.torch_threads)
    bus = RabbitBus(settings, name="aggregator")
    metrics = Metrics()
    bus.on_traffic = metrics.traffic
    bus.on_dead_letter = metrics.dead_letter
    metrics.serve(settings.metrics_port)
    serve(AggregatorService(settings, bus, metrics), bus, "aggregator")
