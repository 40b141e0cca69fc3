"""Learner: take one task at a time, train off the bus thread, publish the update, then ack.

A learner with FEDMQ_SITES takes tasks from those sites' queues only (the scheduler routes a
site's tasks there); otherwise it takes logical clients' tasks from the shared queue.

Ack policy: a task is acked only after its ClientUpdate (or ClientFailure) is
published, so a learner that dies mid-task leaves the task to be redelivered.
An undecodable task is dead-lettered. On shutdown an unfinished task is
returned to the queue, and so is a task whose model fetch the broker lost
FETCH_ATTEMPTS times (never a client's failure). User code that raises (loading data, building the model,
training) is a ClientFailure with code `user_code` and the error's phase, type
and message; the job's `clients.on_error` decides whether it fails the job.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from pathlib import Path

import structlog
import torch

from fedmq.common.allowlist import AllowList
from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.errors import BrokerUnavailable, DecodeError, FedmqError, ValidationError
from fedmq.common.messages import (
    ClientFailure,
    ClientStateGet,
    ClientStateReply,
    DdpLaunch,
    DdpStop,
    EvalTask,
    Heartbeat,
    Message,
    ModelGet,
    ModelReply,
    TrainTask,
    UserError,
    expect,
    from_wire,
    to_wire,
)
from fedmq.common.metrics import Metrics
from fedmq.common.senders import check_sender
from fedmq.common.settings import Settings
from fedmq.common.usercode import UserCodeError
from fedmq.services.learner.ddp import DdpRunner
from fedmq.services.learner.device import resolve_device
from fedmq.services.learner.work import Work

log = structlog.get_logger("fedmq.learner")

Task = TrainTask | EvalTask
FETCH_ATTEMPTS = 5  # model fetches lost to the broker before the task goes back to the queue


class LearnerService:
    def __init__(
        self, settings: Settings, bus: Bus, replica: int | None = None, metrics: Metrics | None = None,
        allowed: AllowList | None = None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.metrics = metrics or Metrics()
        given = settings.replica if settings.replica is not None else replica
        self.replica = given if given is not None else 0
        self.node = settings.node or socket.gethostname()
        # Without a replica index (compose has none) the pid keeps names on one host apart.
        self.name = f"{self.node}/{given}" if given is not None else f"{self.node}/pid{os.getpid()}"
        self.work = Work(settings, self.name, self._fetch, self.metrics, self._fetch_state, allowed)
        # Picked and checked here, before the process connects anywhere: a bad FEDMQ_DEVICE is a
        # start-up error, not a learner that joins the fleet and then cannot train.
        self.work.device = resolve_device(settings.device, self.replica)
        self._tasks: queue.SimpleQueue[tuple[Task, Delivery] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._stopping = False
        self._current: Delivery | None = None
        self.redelivered = 0  # tasks that reached this learner marked as redelivered
        self.ddp = DdpRunner(bus, self.name, self.node, Path(settings.state_dir) / "learner", self._fetch)

    @property
    def device(self) -> torch.device:
        return self.work.device

    @property
    def fetches(self) -> int:
        """Global models fetched over the bus (the rest came from the cache)."""
        return self.work.fetches

    def start(self) -> None:
        # torch imports its compiler stack (~2 s here) on the first optimizer it builds:
        # pay that at start-up, not inside the first round.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        # A daemon thread: a stopping process does not wait for a half-done training step.
        self._worker = threading.Thread(target=self._work, name=f"train-{self.replica}", daemon=True)
        self._worker.start()
        # A learner hosting sites takes their tasks only (its data is theirs); else any logical client's.
        sites = self.settings.site_names
        for name in [topology.site_queue(site) for site in sites] or [topology.TASKS]:
            self.bus.consume(name, self.on_task, prefetch=1)
        # Its own queue: the scheduler's launch and stop of a DDP group's rank on this learner.
        self.bus.consume(topology.learner_queue(self.name), self.on_control, prefetch=4)
        self.bus.call_soon(self._heartbeat)
        log.info("learner_started", learner=self.name, device=str(self.device), sites=list(sites))

    def _heartbeat(self) -> None:
        """Tell the scheduler we are alive, and whether busy; re-armed on the bus thread."""
        if self._stopping:
            return  # it said goodbye (_leave): a beat now would bring it back to the table
        beat = Heartbeat(
            learner=self.name, node=self.node, replica=self.replica, device=str(self.device),
            busy=self._current is not None or self.ddp.active, pid=os.getpid(),
            interval_s=self.settings.liveness_s, sites=list(self.settings.site_names), group=self.ddp.group,
        )
        try:
            self.bus.publish(topology.SCHEDULER, to_wire(beat))
        finally:
            self.bus.call_later(self.settings.liveness_s, self._heartbeat)

    def _leave(self) -> None:
        """Tell the scheduler this learner is gone (not lost): `fedmq learners` drops it at once."""
        beat = Heartbeat(learner=self.name, node=self.node, replica=self.replica, device=str(self.device),
                         pid=os.getpid(), interval_s=self.settings.liveness_s, leaving=True)
        self.bus.publish(topology.SCHEDULER, to_wire(beat))

    def shutdown(self) -> None:
        """Stop taking work; safe from a signal handler (a flag, and SimpleQueue.put, which is).

        An unfinished task is neither published nor acked: when the bus stops, its
        connection closes and the broker hands the task to another learner.
        """
        self._stopping = True
        self._tasks.put(None)  # the training thread ends once its current task has
        self.bus.call_soon_from_signal(self._leave)  # on the bus thread, before it stops
        threading.Thread(target=self.ddp.shutdown, daemon=True).start()  # not in a signal handler

    def join(self, timeout: float | None = None) -> bool:
        """After shutdown(): wait for the training thread to end; False if it still trains."""
        if self._worker is not None:
            self._worker.join(timeout)
        return self._worker is None or not self._worker.is_alive()

    def on_task(self, delivery: Delivery) -> None:
        try:
            task = _task(from_wire(delivery.body, max_bytes=self.settings.frame_bytes))
        except DecodeError as exc:
            log.warning("message_rejected", reason="decode", detail=str(exc))
            delivery.reject(f"decode: {exc}")
            return
        try:
            check_sender(task.type, delivery.user_id, self.settings.role_users)
        except ValidationError as exc:
            log.warning("message_rejected", reason=exc.reason, detail=exc.detail[:500])
            delivery.reject(str(exc))
            return
        if delivery.redelivered:
            self.redelivered += 1
            log.info("task_redelivered", job=task.job_id, round=task.round, client=task.client)
        self._current = delivery  # prefetch 1: at most one task is ours at a time
        self._tasks.put((task, delivery))

    def on_control(self, delivery: Delivery) -> None:
        """The scheduler's DdpLaunch and DdpStop for this learner."""
        try:
            msg = from_wire(delivery.body, max_bytes=self.settings.frame_bytes)
            check_sender(msg.type, delivery.user_id, self.settings.role_users)  # type: ignore[attr-defined]
            if not isinstance(msg, DdpLaunch | DdpStop):
                raise DecodeError(f"unexpected message type {msg.type!r} on a learner's own queue")  # type: ignore[attr-defined]
        except (DecodeError, ValidationError) as exc:
            log.warning("message_rejected", reason=getattr(exc, "reason", "decode"), detail=str(exc)[:500])
            delivery.reject(str(exc))
            return
        if isinstance(msg, DdpLaunch):
            self.ddp.launch(msg, self._check_entry)
        else:
            self.ddp.stop(msg)
        delivery.ack()

    def _check_entry(self, entry: str) -> None:
        """As the scheduler did: a launch may have come another way (CodeNotAllowed fails the rank)."""
        self.work.allowed.check(entry.partition(":")[0], "entry", entry)

    def _work(self) -> None:
        while (item := self._tasks.get()) is not None and not self._stopping:
            # In a DDP group: the task waits, unacked (prefetch 1: no other comes meanwhile); the
            # round's nudge sends it to another learner if the group outlasts the round.
            while self.ddp.active and not self._stopping:
                time.sleep(0.5)
            self._run(*item)

    def _run(self, task: Task, delivery: Delivery) -> None:
        # contextvars are per thread: bind here, where the work runs.
        with structlog.contextvars.bound_contextvars(job=task.job_id, round=task.round, client=task.client):
            try:
                reply = self._work_retrying(task)
            except BrokerUnavailable as exc:
                # The broker's trouble, not the client's: the task goes back, nothing is reported.
                log.warning("task_returned", error=str(exc)[:300])
                self._current = None
                delivery.requeue()
                return
            except UserCodeError as exc:
                log.warning("user_code_failed", phase=exc.phase, error_type=exc.error_type,
                            error=exc.message[:300])
                error = exc.info("learner", round=task.round, client=task.client, learner=self.name)
                reply = self._failure(task, "user_code", error.line(), error)
            except FedmqError as exc:
                log.warning("task_failed", error=str(exc))
                reply = self._failure(task, "invalid", str(exc))
            except Exception as exc:
                log.exception("task_crashed")
                reply = self._failure(task, "error", f"{type(exc).__name__}: {exc}")
            if self._stopping:
                return  # the task goes back to the queue with our connection
            try:
                self.bus.publish(reply[0], reply[1])
            except Exception as exc:
                # Not confirmed, so not acked: the broker hands the task out again.
                log.warning("publish_failed", error=str(exc)[:300])
                self._current = None
                delivery.requeue()
                return
            self._current = None
            delivery.ack()

    def _work_retrying(self, task: Task) -> tuple[str, bytes]:
        """Train or evaluate; a model fetch lost to the broker is tried again after a backoff."""
        delay = self.settings.retry_initial_s
        for _ in range(FETCH_ATTEMPTS - 1):
            try:
                return self._do(task)
            except BrokerUnavailable as exc:
                if self._stopping:
                    raise
                log.warning("model_fetch_retry", error=str(exc)[:300], retry_in_s=round(delay, 2))
                time.sleep(delay)  # the training thread: the bus thread keeps the connection alive
                delay = min(delay * 2, self.settings.retry_max_s)
        return self._do(task)

    def _do(self, task: Task) -> tuple[str, bytes]:
        """The reply a task gets: an EvalReport for the scheduler, a ClientUpdate for the aggregator."""
        if isinstance(task, EvalTask):
            return topology.SCHEDULER, to_wire(self.work.evaluate(task))
        return topology.AGGREGATOR, to_wire(self.work.train(task))

    def _failure(
        self, task: Task, code: str, reason: str, error: UserError | None = None
    ) -> tuple[str, bytes]:
        failure = ClientFailure(
            job_id=task.job_id, task_id=task.task_id, round=task.round, client=task.client,
            code=code, reason=reason[:500], learner=self.name, error=error,
        )
        return topology.SCHEDULER, to_wire(failure)

    def _fetch(self, job_id: str, digest: str) -> tuple[dict[str, torch.Tensor], int]:
        """A global model from the aggregator by digest (request/reply over the bus), and its size."""
        request = to_wire(ModelGet(job_id=job_id, digest=digest))
        try:
            body = self.bus.request(topology.MODEL, request, timeout=self.settings.request_timeout_s)
        except Exception as exc:  # lost connection, no reply in time, not connected: the transport's
            raise BrokerUnavailable(f"model fetch failed: {type(exc).__name__}: {exc}") from exc
        reply = expect(from_wire(body, max_bytes=self.settings.max_message_bytes), ModelReply)
        if reply.error or reply.weights is None:
            raise FedmqError(f"model {digest[:12]} unavailable: {reply.error}")
        return dict(reply.weights), len(body)

    def _fetch_state(self, job_id: str, server_round: int, client: int) -> dict[str, torch.Tensor]:
        """The strategy's stored state of a client, from the aggregator (request/reply over the bus)."""
        request = to_wire(ClientStateGet(job_id=job_id, round=server_round, client=client))
        try:
            body = self.bus.request(topology.MODEL, request, timeout=self.settings.request_timeout_s)
        except Exception as exc:  # the transport's trouble, like a model fetch's
            raise BrokerUnavailable(f"client state fetch failed: {type(exc).__name__}: {exc}") from exc
        reply = expect(from_wire(body, max_bytes=self.settings.max_message_bytes), ClientStateReply)
        if reply.error or reply.state is None:
            raise FedmqError(f"client {client}'s state for round {server_round} unavailable: {reply.error}")
        return dict(reply.state)


def _task(msg: Message) -> Task:
    if isinstance(msg, TrainTask | EvalTask):
        return msg
    raise DecodeError(f"unexpected message type {msg.type!r} on the task queue")  # type: ignore[attr-defined]
