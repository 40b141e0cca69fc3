"""Wiring of a learner process: its service on RabbitMQ with metrics, served until a signal."""

from __future__ import annotations

from fedmq.common.lifecycle import run_service
from fedmq.common.settings import Settings
from fedmq.services.learner.service import LearnerService


def main(settings: Settings) -> None:
    # SIGTERM: an unfinished task goes back to the queue for another learner.
    run_service("learner", settings, LearnerService, uses_torch=True, on_stop=LearnerService.shutdown)
