"""Running one service as a process: connect, serve until SIGTERM/SIGINT, stop cleanly."""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

import structlog

from fedmq.common.bus.base import Bus
from fedmq.common.bus.factory import bus_of_process
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings

STOP_GRACE_S = 2.0  # a signalled service stops within this, whatever its bus is doing

log = structlog.get_logger("fedmq.lifecycle")


class Service(Protocol):
    def start(self) -> None: ...


S = TypeVar("S", bound=Service)
S_co = TypeVar("S_co", bound=Service, covariant=True)


class ServiceFactory(Protocol[S_co]):
    """How every service class is built: settings, its bus, its metrics."""

    def __call__(self, settings: Settings, bus: Bus, *, metrics: Metrics) -> S_co: ...


def run_service(
    name: str,
    settings: Settings,
    factory: ServiceFactory[S],
    *,
    uses_torch: bool = False,
    on_stop: Callable[[S], None] | None = None,
) -> None:
    """Serve one service as this process: a RabbitMQ bus, metrics on their port, until a signal.

    `uses_torch` limits torch's threads first (the scheduler never imports torch);
    `on_stop(service)` runs when a signal arrives, before the bus stops.
    """
    if uses_torch:
        limit_torch_threads(settings.torch_threads)
    bus = bus_of_process(settings, name)
    metrics = Metrics()
    bus.on_traffic = metrics.traffic
    bus.on_dead_letter = metrics.dead_letter
    # Built before anything opens: a service checks its settings (a learner its device) here.
    service = factory(settings, bus, metrics=metrics)
    metrics.serve(settings.metrics_port)
    serve(service, bus, name, on_stop=None if on_stop is None else functools.partial(on_stop, service))


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
        # After what on_stop queued (a learner's goodbye to the scheduler); and in any case soon,
        # even while the bus waits to reconnect and drains nothing.
        bus.call_soon_from_signal(bus.stop)
        backstop = threading.Timer(STOP_GRACE_S, bus.stop)
        backstop.daemon = True  # the process ends when the bus does, not when this fires
        backstop.start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    service.start()
    log.info("service_started", service=name, broker=bus.settings.safe_broker_url)
    bus.run()
    close = getattr(service, "close", None)
    if callable(close):  # what it keeps on disk for this process alone (a learner's fetched models)
        close()
    log.info("service_stopped", service=name)
