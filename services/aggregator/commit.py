"""The aggregator's group commit, and the queue that waits behind a failed state write.

    ClientUpdate ─▶ checked, staged (store.stage_update) ─▶ defer ─┐   (prefetch PREFETCH)
    GroupUpdate  ─▶ its members checked, staged (stage_group) ─▶ defer ─┤
                                 bus idle, or any other message ─▶ commit:
                                     store.commit_staged per job    (durable at once)
                                     a round every client of which is stored now, and that its
                                       RoundOpen lets close here: closed (close_complete)
                                     UpdateAccepted / UpdatesAccepted, one per round ─▶ scheduler
                                       (a closed round's last: `closed`, then its RoundClosed)
                                     ack each

The group commit is the inbox's (common/inbox.py): this one's save is the store and the
announcement. A commit whose write fails (disk full) or whose announcement fails stalls the
queue: its updates, the message that asked for the commit, and every delivery after them wait
unacked, in order, and are handled again (`process`) after a backoff (stateretry), as duplicates
where they were stored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import structlog

from fedmq.common import inbox
from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.errors import StateUnwritable
from fedmq.common.messages import RoundClosed, UpdateAccepted, UpdatesAccepted, to_wire
from fedmq.common.metrics import Metrics
from fedmq.common.stateretry import StateRetry
from fedmq.services.aggregator.intake import in_messages
from fedmq.services.aggregator.jobs import AggJob

log = structlog.get_logger("fedmq.aggregator")

PREFETCH = 8  # updates that may come together, to be stored and announced together (group commit)


class _Unannounced(Exception):
    """`count` updates are stored, their announcement failed (`cause`)."""

    def __init__(self, cause: Exception, count: int) -> None:
        super().__init__(repr(cause))
        self.cause, self.count = cause, count


# What an update or a group staged: its job, its members' announcements, and how many it stores.
Staged = tuple[AggJob, list[UpdateAccepted], int]


class GroupCommit:
    """Updates staged and not yet settled, and the deliveries waiting behind a stalled write."""

    def __init__(
        self, bus: Bus, metrics: Metrics, retry: StateRetry, backoff_s: float,
        process: Callable[[Delivery], None], measure: Callable[[AggJob], None],
        close: Callable[[AggJob], RoundClosed | None] = lambda job: None,
        tidy: Callable[[AggJob], None] = lambda job: None,
    ) -> None:
        self.bus = bus
        self.metrics = metrics
        self.retry = retry
        self.backoff_s = backoff_s  # before a retry whose cause was not a state write
        self.process = process  # handles a delivery again after the backoff
        self.measure = measure  # a job's disk is walked again: a failed commit's files are gone
        self.close = close  # closes a job's round whose every update is stored (None: it did not)
        self.tidy = tidy  # a closed round's files, once its RoundClosed is sent
        self._group: inbox.GroupCommit[Staged] = inbox.GroupCommit(bus, retry, self._store, self._failed)
        self._stalled = False  # a failed state write waits for its retry
        self._backlog: deque[Delivery] = deque()  # what waits behind it, in order

    def hold(self, delivery: Delivery) -> bool:
        """Keep `delivery` back if a state write waits for its retry (the queue waits behind it, in
        order); False, and nothing kept, if none does."""
        if self._stalled:
            self._backlog.append(delivery)
        return self._stalled

    def defer(self, job: AggJob, delivery: Delivery, replies: list[UpdateAccepted], new: int) -> None:
        """Settle an update (or a group's, `new` of them new) with those that came with it: stored
        together, announced in one message per round, acked together, once the deliveries that
        have arrived are handled."""
        self._group.add(delivery, (job, replies, new))

    def commit(self, then: Delivery | None = None) -> bool:
        """Store, announce and ack the deferred updates. False if storing failed: then they, and
        `then` after them, wait unacked to be handled again after a backoff (their files deleted,
        the job's disk measured again)."""
        return self._group.flush(then)

    def _store(self, staged: list[Staged]) -> None:
        """The group's save: every job's staged updates made durable, then announced, one message a round."""
        jobs = list({id(job): job for job, _, _ in staged}.values())
        try:
            for job in jobs:
                job.store.commit_staged()
        except StateUnwritable:
            for job in jobs:
                self.measure(job)
            raise
        self.metrics.updates_accepted.inc(sum(new for _, _, new in staged))
        by_round: dict[tuple[str, int], list[UpdateAccepted]] = {}
        for job, replies, _ in staged:
            for reply in replies:
                by_round.setdefault((reply.job_id, reply.round), []).append(reply)
                if reply.round == job.open_round:
                    job.arrived.add(reply.client)
        closes: dict[tuple[str, int | None], RoundClosed | None] = {}
        closed: list[AggJob] = []  # those whose close is committed, as they come
        try:
            for job in jobs:
                if job.complete():
                    key = (job.job_id, job.open_round)
                    closes[key] = self.close(job)
                    if closes[key] is not None:
                        closed.append(job)
            self.bus.publish_all([(topology.SCHEDULER, body) for body in _announced(by_round, closes)])
        except Exception as exc:
            raise _Unannounced(exc, sum(len(replies) for _, replies, _ in staged)) from exc
        finally:  # committed rounds, announced or not: their updates are folded for good
            for job in closed:
                try:
                    self.tidy(job)
                except Exception as exc:  # its files stay on disk, its close stands: logged
                    log.warning("round_tidy_failed", job=job.job_id, error=repr(exc)[:300])

    def _failed(self, exc: Exception, waiting: list[Delivery]) -> None:
        """The group's save failed: what it leaves unacked waits for a retry (the queue stalls)."""
        if isinstance(exc, _Unannounced):
            # Stored, not announced: after a backoff each is handled again, in order, as a
            # duplicate, and announced then. A lost connection: the broker gives them back.
            live = [delivery for delivery in waiting if delivery.live()]
            if not live:
                raise exc.cause
            log.warning("updates_not_announced", count=exc.count, error=repr(exc.cause)[:300])
            self.stall(exc.cause, live)
            return
        if not isinstance(exc, StateUnwritable):  # a bug: the bus's crash handling, not the inbox's
            raise RuntimeError(f"the group commit failed: {exc!r}") from exc
        self.stall(exc, waiting)

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


def _announced(
    by_round: dict[tuple[str, int], list[UpdateAccepted]],
    closes: dict[tuple[str, int | None], RoundClosed | None],
) -> list[bytes]:
    """Each round's announcements, then the RoundClosed of a round closed with them: the last
    announcement before it says so (UpdatesAccepted.closed), so the scheduler sends no RoundClose."""
    messages = []
    for key, kept in by_round.items():
        parts = in_messages(kept)
        ended = closes.get(key)
        for at, replies in enumerate(parts):
            last = ended is not None and at == len(parts) - 1
            messages.append(to_wire(replies[0] if len(replies) == 1 and not last else UpdatesAccepted(
                job_id=key[0], round=key[1], updates=replies, closed=last)))
    # After every announcement: a round closed without one in this commit (all stored before) too.
    messages.extend(to_wire(ended) for ended in closes.values() if ended is not None)
    return messages
