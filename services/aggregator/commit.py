"""The aggregator's group commit, and the queue that waits behind a failed state write.

    ClientUpdate ─▶ checked, staged (store.stage_update) ─▶ defer ─┐   (prefetch PREFETCH)
    ClientUpdate ─▶ ...                                    ─▶ defer ─┤
                                 bus idle, or any other message ─▶ commit:
                                     store.commit_staged per job    (durable at once)
                                     UpdateAccepted / UpdatesAccepted, one per round ─▶ scheduler
                                     ack each

A commit whose write fails (disk full) or whose announcement fails stalls the queue: its updates,
the message that asked for the commit, and every delivery after them wait unacked, in order, and
are handled again (`process`) after a backoff (stateretry), as duplicates where they were stored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import structlog

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.errors import StateUnwritable
from fedmq.common.messages import UpdateAccepted, UpdatesAccepted, to_wire
from fedmq.common.metrics import Metrics
from fedmq.common.stateretry import StateRetry
from fedmq.services.aggregator.jobs import AggJob

log = structlog.get_logger("fedmq.aggregator")

PREFETCH = 8  # updates that may come together, to be stored and announced together (group commit)


class GroupCommit:
    """Updates staged and not yet settled, and the deliveries waiting behind a stalled write."""

    def __init__(
        self, bus: Bus, metrics: Metrics, retry: StateRetry, backoff_s: float,
        process: Callable[[Delivery], None], measure: Callable[[AggJob], None],
    ) -> None:
        self.bus = bus
        self.metrics = metrics
        self.retry = retry
        self.backoff_s = backoff_s  # before a retry whose cause was not a state write
        self.process = process  # handles a delivery again after the backoff
        self.measure = measure  # a job's disk is walked again: a failed commit's files are gone
        # Updates staged and not yet settled: their job, delivery, announcement, and whether new.
        self._pending: list[tuple[AggJob, Delivery, UpdateAccepted, bool]] = []
        self._stalled = False  # a failed state write waits for its retry
        self._backlog: deque[Delivery] = deque()  # what waits behind it, in order

    def hold(self, delivery: Delivery) -> bool:
        """Keep `delivery` back if a state write waits for its retry (the queue waits behind it, in
        order); False, and nothing kept, if none does."""
        if self._stalled:
            self._backlog.append(delivery)
        return self._stalled

    def defer(self, job: AggJob, delivery: Delivery, reply: UpdateAccepted, new: bool) -> None:
        """Settle an update with those that came with it: stored together, announced in one
        message per round, acked together, once the deliveries that have arrived are handled."""
        if not self._pending:
            self.bus.call_when_idle(self._commit_now)
        self._pending.append((job, delivery, reply, new))

    def _commit_now(self) -> None:
        self.commit()

    def commit(self, then: Delivery | None = None) -> bool:
        """Store, announce and ack the deferred updates. False if storing failed: then they, and
        `then` after them, wait unacked to be handled again after a backoff (their files deleted,
        the job's disk measured again)."""
        if not self._pending:
            return True
        pending, self._pending = self._pending, []
        jobs = list({id(job): job for job, _, _, _ in pending}.values())
        deliveries = [delivery for _, delivery, _, _ in pending]
        waiting = deliveries + ([then] if then else [])  # what waits for a retry if this fails
        try:
            for job in jobs:
                job.store.commit_staged()
        except StateUnwritable as exc:
            for job in jobs:
                self.measure(job)
            self.stall(exc, waiting)
            return False
        self.metrics.updates_accepted.inc(sum(new for _, _, _, new in pending))
        by_round: dict[tuple[str, int], list[UpdateAccepted]] = {}
        for _, _, reply, _ in pending:
            by_round.setdefault((reply.job_id, reply.round), []).append(reply)
        try:
            self.bus.publish_all([
                (topology.SCHEDULER, to_wire(replies[0] if len(replies) == 1 else
                                             UpdatesAccepted(job_id=job_id, round=rnd, updates=replies)))
                for (job_id, rnd), replies in by_round.items()
            ])
        except Exception as exc:
            # Stored, not announced: after a backoff each is handled again, in order, as a
            # duplicate, and announced then. A lost connection: the broker gives them back.
            live = [delivery for delivery in waiting if delivery.live()]
            if not live:
                raise
            log.warning("updates_not_announced", count=len(pending), error=repr(exc)[:300])
            self.stall(exc, live)
            return False
        self.retry.succeeded()
        for delivery in deliveries:
            delivery.ack()
        return True

    def stall(self, exc: Exception, deliveries: list[Delivery]) -> None:
        """A state write (or a group's announcement) failed: `deliveries`, then every later one,
        wait unacked for the retry after a backoff."""
        if not self._stalled:
            if isinstance(exc, StateUnwritable):
                self.retry.later(exc, self._resume)
            else:
                self.bus.call_later(self.backoff_s, self._resume)
        self._stalled = True
        self._backlog.extendleft(reversed(deliveries))

    def _resume(self) -> None:
        """After the backoff: the waiting deliveries again, in order, until one stalls again. One
        whose connection has gone since is dropped: the broker gives it again, behind the others."""
        self._stalled = False
        while self._backlog and not self._stalled:
            delivery = self._backlog.popleft()
            if not delivery.live():
                continue
            try:
                self.process(delivery)
            except Exception as exc:  # as the bus does for a handler: dead-lettered, the rest go on
                if not delivery.live():
                    raise  # the connection is gone: the bus connects again, the broker gives them back
                log.exception("handler_crashed", queue=delivery.queue)
                delivery.reject(f"handler_error: {type(exc).__name__}")
