"""Learner: take one task at a time, train off the bus thread, publish the update, then ack.

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
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import structlog
import torch
from torch import nn

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.errors import BrokerUnavailable, DecodeError, FedmqError
from fedmq.common.jobspec import JobSpec, canonical_json, parse_job
from fedmq.common.messages import (
    ClientFailure,
    ClientUpdate,
    Heartbeat,
    ModelGet,
    ModelReply,
    TrainTask,
    UserError,
    expect,
    from_wire,
    to_wire,
)
from fedmq.common.metrics import Metrics
from fedmq.common.seeding import torch_generator
from fedmq.common.settings import Settings
from fedmq.common.usercode import UserCodeError, user_code
from fedmq.common.workloads.datasets import load_dataset
from fedmq.common.workloads.models import build_model
from fedmq.common.workloads.partition import partition
from fedmq.common.workloads.plugins import load_entrypoint
from fedmq.services.learner.device import resolve_device
from fedmq.services.learner.training import train_local

log = structlog.get_logger("fedmq.learner")

MODEL_CACHE = 2  # the current round's weights, and the previous one for stragglers
FETCH_ATTEMPTS = 5  # model fetches lost to the broker before the task goes back to the queue


@dataclass
class JobContext:
    """What a learner keeps per job between tasks: data, partition and a model to reuse."""

    spec: JobSpec
    x: torch.Tensor
    y: torch.Tensor
    parts: list[np.ndarray]
    model: nn.Module


class LearnerService:
    def __init__(
        self, settings: Settings, bus: Bus, replica: int | None = None, metrics: Metrics | None = None
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.metrics = metrics or Metrics()
        given = settings.replica if settings.replica is not None else replica
        self.replica = given if given is not None else 0
        self.node = settings.node or socket.gethostname()
        # Without a replica index (compose has none) the pid keeps names on one host apart.
        self.name = f"{self.node}/{given}" if given is not None else f"{self.node}/pid{os.getpid()}"
        # Picked and checked here, before the process connects anywhere: a bad FEDMQ_DEVICE is a
        # start-up error, not a learner that joins the fleet and then cannot train.
        self.device = resolve_device(settings.device, self.replica)
        self._tasks: queue.SimpleQueue[tuple[TrainTask, Delivery] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._stopping = False
        self._contexts: OrderedDict[str, JobContext] = OrderedDict()
        self._models: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._current: Delivery | None = None
        self.fetches = 0  # global models fetched over the bus (the rest came from the cache)
        self.redelivered = 0  # tasks that reached this learner marked as redelivered

    def start(self) -> None:
        # torch imports its compiler stack (~2 s here) on the first optimizer it builds:
        # pay that at start-up, not inside the first round.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        # A daemon thread: a stopping process does not wait for a half-done training step.
        self._worker = threading.Thread(target=self._work, name=f"train-{self.replica}", daemon=True)
        self._worker.start()
        self.bus.consume(topology.TASKS, self.on_task, prefetch=1)
        self.bus.call_soon(self._heartbeat)
        log.info("learner_started", learner=self.name, device=str(self.device))

    def _heartbeat(self) -> None:
        """Tell the scheduler we are alive, and whether busy; re-armed on the bus thread."""
        beat = Heartbeat(
            learner=self.name, node=self.node, replica=self.replica, device=str(self.device),
            busy=self._current is not None, pid=os.getpid(), interval_s=self.settings.liveness_s,
        )
        try:
            self.bus.publish(topology.SCHEDULER, to_wire(beat))
        finally:
            self.bus.call_later(self.settings.liveness_s, self._heartbeat)

    def shutdown(self) -> None:
        """Stop taking work; safe from a signal handler (a flag, and SimpleQueue.put, which is).

        An unfinished task is neither published nor acked: when the bus stops, its
        connection closes and the broker hands the task to another learner.
        """
        self._stopping = True
        self._tasks.put(None)  # the training thread ends once its current task has

    def join(self, timeout: float | None = None) -> bool:
        """After shutdown(): wait for the training thread to end; False if it still trains."""
        if self._worker is not None:
            self._worker.join(timeout)
        return self._worker is None or not self._worker.is_alive()

    def on_task(self, delivery: Delivery) -> None:
        try:
            task = expect(from_wire(delivery.body, max_bytes=self.settings.frame_bytes), TrainTask)
        except DecodeError as exc:
            log.warning("message_rejected", reason="decode", detail=str(exc))
            delivery.reject(f"decode: {exc}")
            return
        if delivery.redelivered:
            self.redelivered += 1
            log.info("task_redelivered", job=task.job_id, round=task.round, client=task.client)
        self._current = delivery  # prefetch 1: at most one task is ours at a time
        self._tasks.put((task, delivery))

    def _work(self) -> None:
        while (item := self._tasks.get()) is not None and not self._stopping:
            self._run(*item)

    def _run(self, task: TrainTask, delivery: Delivery) -> None:
        # contextvars are per thread: bind here, where the work runs.
        with structlog.contextvars.bound_contextvars(job=task.job_id, round=task.round, client=task.client):
            try:
                reply = self._train_retrying(task)
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

    def _train_retrying(self, task: TrainTask) -> tuple[str, bytes]:
        """Train; a model fetch lost to the broker is tried again after a backoff, then given up."""
        delay = self.settings.retry_initial_s
        for _ in range(FETCH_ATTEMPTS - 1):
            try:
                return self._train(task)
            except BrokerUnavailable as exc:
                if self._stopping:
                    raise
                log.warning("model_fetch_retry", error=str(exc)[:300], retry_in_s=round(delay, 2))
                time.sleep(delay)  # the training thread: the bus thread keeps the connection alive
                delay = min(delay * 2, self.settings.retry_max_s)
        return self._train(task)

    def _train(self, task: TrainTask) -> tuple[str, bytes]:
        ctx = self._context(task)
        weights = self._global_weights(task)
        started = time.perf_counter()
        ctx.model.load_state_dict(weights)
        indices = torch.from_numpy(ctx.parts[task.client])
        generator = torch_generator(ctx.spec.seed, "train", task.round, task.client)
        with user_code("train", round=task.round, client=task.client):
            train_fn = train_local
            if ctx.spec.train.entrypoint:
                train_fn = load_entrypoint(ctx.spec.train.entrypoint)
            metrics = train_fn(
                ctx.model, ctx.x[indices], ctx.y[indices], ctx.spec.train, generator, self.device
            )
            metrics = {k: float(v) for k, v in metrics.items()}
        state = {k: v.detach().to("cpu", copy=True) for k, v in ctx.model.state_dict().items()}
        seconds = time.perf_counter() - started
        self.metrics.train_seconds.observe(seconds)
        log.info("task_trained", examples=len(indices), seconds=round(seconds, 4),
                 loss=round(float(metrics.get("loss", float("nan"))), 4))
        update = ClientUpdate(
            job_id=task.job_id,
            task_id=task.task_id,
            round=task.round,
            client=task.client,
            base_digest=task.model_digest,
            num_examples=len(indices),
            metrics=metrics,
            train_seconds=seconds,
            learner=self.name,
            weights=state,
        )
        return topology.AGGREGATOR, to_wire(update)

    def _failure(
        self, task: TrainTask, code: str, reason: str, error: UserError | None = None
    ) -> tuple[str, bytes]:
        failure = ClientFailure(
            job_id=task.job_id, task_id=task.task_id, round=task.round, client=task.client,
            code=code, reason=reason[:500], learner=self.name, error=error,
        )
        return topology.SCHEDULER, to_wire(failure)

    def _context(self, task: TrainTask) -> JobContext:
        key = task.job_id  # a job's spec never changes after submission
        ctx = self._contexts.get(key)
        if ctx is None:
            spec = parse_job(task.spec)
            with user_code("load_data", round=task.round, client=task.client):
                data = load_dataset(spec.data, spec.seed)
                parts = partition(data.y_train, spec.clients.total, spec.data.partition, spec.seed)
            with user_code("build_model", round=task.round, client=task.client):
                model = build_model(spec.model, data.input_shape, data.num_classes, spec.seed)
            ctx = JobContext(spec, torch.tensor(data.x_train), torch.tensor(data.y_train),
                             parts, model.to(self.device))
            self._contexts[key] = ctx
            while len(self._contexts) > 4:
                self._contexts.popitem(last=False)
            log.info("job_loaded", spec=canonical_json(spec)[:200])
        return ctx

    def _global_weights(self, task: TrainTask) -> dict[str, torch.Tensor]:
        """The round's global model: from the cache by digest, else fetched once."""
        weights = self._models.get(task.model_digest)
        if weights is not None:
            self._models.move_to_end(task.model_digest)
            return weights
        request = to_wire(ModelGet(job_id=task.job_id, digest=task.model_digest))
        try:
            body = self.bus.request(topology.MODEL, request, timeout=self.settings.request_timeout_s)
        except Exception as exc:  # lost connection, no reply in time, not connected: the transport's
            raise BrokerUnavailable(f"model fetch failed: {type(exc).__name__}: {exc}") from exc
        reply = expect(from_wire(body, max_bytes=self.settings.max_message_bytes), ModelReply)
        if reply.error or reply.weights is None:
            raise FedmqError(f"model {task.model_digest[:12]} unavailable: {reply.error}")
        self.fetches += 1
        self.metrics.model_fetches.inc()
        weights = dict(reply.weights)
        self._models[task.model_digest] = weights
        while len(self._models) > MODEL_CACHE:
            self._models.popitem(last=False)
        return weights
