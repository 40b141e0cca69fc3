"""Running one service as a process: connect, serve until SIGTERM/SIGINT, stop cleanly."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Protocol

import structlog

from fedmq.common.bus.rabbitmq import RabbitBus

log = structlog.get_logger("fedmq.lifecycle")


class Service(Protocol):
    def start(self) -> None: ...


def limit_torch_threads(threads: int) -> None:
    """One torch thread per process unless FEDMQ_TORCH_THREADS says otherwise.

    CPU learners scale by replicas, one per core: with torch's default (a thread per
    core in every process) three learners on two cores spent up to 1.9 s on a 0.05 s
    task, their OpenMP threads spinning against each other.
    """
    import torch

    torch.set_num_threads(threads or 1)


def serve(service: Service, bus: RabbitBus, name: str, on_stop: Callable[[], None] | None = None) -> None:
    """Block serving `service` until a signal; BrokerUnavailable escapes if the first connect fails."""
    bus.connect()  # fail fast with one clear error instead of retrying forever at start-up

    def stop(signum: int, _frame: object) -> None:
        log.info("service_stopping", service=name, signal=signal.Signals(signum).name)
        if on_stop is not None:
            on_stop()
        bus.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    service.start()
    log.info("service_started", service=name, broker=bus.settings.safe_broker_url)
    bus.run()
    log.info("service_stopped", service=name)
