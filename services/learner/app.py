"""Wiring of a learner process: settings in, bus and service built, served until a signal."""

from __future__ import annotations

from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.lifecycle import limit_torch_threads, serve
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.services.learner.service import LearnerService


def main(settings: Settings) -> None:
    limit_torch_threads(settings.torch_threads)
    bus = RabbitBus(settings, name="learner")
    metrics = Metrics()
    bus.on_traffic = metrics.traffic
    bus.on_dead_letter = metrics.dead_letter
    metrics.serve(settings.metrics_port)
    service = LearnerService(settings, bus, metrics=metrics)
    # SIGTERM: an unfinished task goes back to the queue for another learner.
    serve(service, bus, "learner", on_stop=service.shutdown)
