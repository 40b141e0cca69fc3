"""A message whose effect could not be written to disk is kept, unacked, and handled again later.

    handler ─✗ StateUnwritable ─▶ log `state_unwritable` (path, errno), count it,
                                  call_later(backoff): the same delivery through the handler again
    the delivery stays unacked, so its queue waits (prefetch) and nothing is lost or counted twice;
    backoff doubles from FEDMQ_RETRY_INITIAL_S to FEDMQ_STATE_RETRY_MAX_S, and resets on a success

A full or read-only state directory is neither a bad message (dead-lettered) nor a crash:
it is a wait, loud in the logs and in `fedmq_state_write_errors_total`, until there is room.
"""

from __future__ import annotations

import errno as errnos
from collections.abc import Callable

import structlog

from fedmq.common.bus.base import Bus
from fedmq.common.errors import StateUnwritable
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings

log = structlog.get_logger("fedmq.state")


class StateRetry:
    """One service's retries of work whose state write failed."""

    def __init__(self, bus: Bus, metrics: Metrics, settings: Settings) -> None:
        self.bus = bus
        self.metrics = metrics
        self.initial = settings.retry_initial_s
        self.cap = max(settings.state_retry_max_s, settings.retry_initial_s)
        self._delay = self.initial

    def later(self, exc: StateUnwritable, again: Callable[[], None]) -> None:
        """Log the failed write and run `again` on the bus thread after the backoff."""
        name = errnos.errorcode.get(exc.errno, "") if exc.errno is not None else ""
        log.error("state_unwritable", path=exc.path, errno=exc.errno, code=name, error=exc.detail,
                  retry_in_s=round(self._delay, 2))
        self.metrics.state_write_errors.inc()
        self.bus.call_later(self._delay, again)
        self._delay = min(self._delay * 2, self.cap)

    def succeeded(self) -> None:
        """A write went through: the next failure starts from the first backoff again."""
        self._delay = self.initial
