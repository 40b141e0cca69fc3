"""Learner: take a message of tasks, train off the bus thread, publish the updates, then ack.

The scheduler sends each learner its share of a round's tasks in one message (a TrainTasks; a
lone task as a TrainTask), taken one at a time (prefetch 1). The tasks of a job that fuses
(`train.fuse`) train together, in groups of at most FEDMQ_FUSE_CLIENTS (work.train_group), and
their updates travel as one GroupUpdate (common/groups.py), published before the message is acked;
the aggregator keeps each member's update as if it had come alone.

A learner with FEDMQ_SITES takes tasks from those sites' queues only (the scheduler routes a
site's tasks there); otherwise it takes logical clients' tasks from the shared queue.

Ack policy: a message is acked only after each of its tasks' ClientUpdate (or ClientFailure) is
published, so a learner that dies mid-task leaves the message to be redelivered (the replies
already published come again as duplicates, which the aggregator and scheduler drop).
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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import structlog
import torch

from fedmq.common.allowlist import AllowList
from fedmq.common.bus import topology
from fedmq.common.bus.base import Body, Bus, Delivery, SharedDelivery
from fedmq.common.codec import TensorFile, state_digest
from fedmq.common.codec.compress import Downlink, encoded_nbytes
from fedmq.common.errors import BrokerUnavailable, FedmqError
from fedmq.common.groups import group_of, groupable
from fedmq.common.heap import large_buffers_unmapped
from fedmq.common.inbox import KEPT, Handled, Inbox
from fedmq.common.messages import (
    ClientStateGet,
    ClientStateReply,
    ClientUpdate,
    DdpLaunch,
    DdpStop,
    EvalTask,
    Heartbeat,
    Message,
    ModelGet,
    ModelReply,
    TrainTask,
    TrainTasks,
    expect,
    from_wire,
    from_wire_file,
    to_wire,
    to_wire_parts,
)
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.common.task.sealing import StateSealer
from fedmq.services.learner.ddp import DdpRunner
from fedmq.services.learner.device import resolve_device
from fedmq.services.learner.models import ModelFolder, SharedModels
from fedmq.services.learner.work import Work, client_failure

log = structlog.get_logger("fedmq.learner")

CONTROL_PREFETCH = 64  # a learner's own queue: control messages and the tasks sent back to it
Task = TrainTask | EvalTask
R = TypeVar("R")

FETCH_ATTEMPTS = 5  # model fetches lost to the broker before the task goes back to the queue
# A fused group's updates travel as one message up to this many bytes of weights (else one by one).
GROUP_MESSAGE_BYTES = 64 * 1024 * 1024


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
        shared = settings.shared_models_dir  # the folder this host's learners share models through
        # A neighbour fetching a model is waited for as long as its own fetch may take, and a margin.
        wait_s = 1.2 * settings.request_timeout_s + 30
        self.shared = (SharedModels(shared, wait_s, settings.max_message_bytes)
                       if shared is not None else None)
        # Large models, as files: beside the shared ones when there are (a share is then a hard link).
        own = shared / "learners" if shared is not None else Path(settings.state_dir) / "learner"
        self.models = ModelFolder(own)
        key = settings.state_key
        sealer = StateSealer(key.get_secret_value()) if key is not None else None
        self.work = Work(settings, self.name, self._fetch_large, self.metrics, self._fetch_state, allowed,
                         sealer)
        # Picked and checked here, before the process connects anywhere: a bad FEDMQ_DEVICE is a
        # start-up error, not a learner that joins the fleet and then cannot train.
        self.work.device = resolve_device(settings.device, self.replica)
        # What the bus thread took, for the training thread: a message's tasks (a TrainTasks' several).
        self._tasks: queue.SimpleQueue[list[tuple[Task, Delivery]] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._stopping = False
        self._held = 0  # tasks taken from the broker and not yet settled (acked or returned)
        self._held_lock = threading.Lock()
        self.redelivered = 0  # tasks that reached this learner marked as redelivered
        self.ddp = DdpRunner(bus, self.name, self.node, Path(settings.state_dir) / "learner", self._fetch)
        # The shared (or a site's) task queue, and its own: control messages, tasks sent back to it.
        self.tasks_inbox = Inbox(settings.role_users, settings.frame_bytes,
                                 takes=(TrainTask, TrainTasks, EvalTask), service="learner")
        self.control_inbox = Inbox(settings.role_users, settings.frame_bytes,
                                   takes=(TrainTask, TrainTasks, DdpLaunch, DdpStop), service="learner")

    @property
    def device(self) -> torch.device:
        return self.work.device

    @property
    def fetches(self) -> int:
        """Global models fetched over the bus (the rest came from the cache)."""
        return self.work.fetches

    def start(self) -> None:
        if self.shared is not None:
            self.shared.check()  # ConfigError: a folder this learner cannot write stops it here
        # A daemon thread: a stopping process does not wait for a half-done training step.
        self._worker = threading.Thread(target=self._work, name=f"train-{self.replica}", daemon=True)
        self._worker.start()
        # A learner hosting sites takes their tasks only (its data is theirs); else any logical client's.
        sites = self.settings.site_names
        # One message at a time: the scheduler sends each learner its share of a round in one (a
        # TrainTasks), and a learner stuck in training holds no other learner's share meanwhile.
        for name in [topology.site_queue(site) for site in sites] or [topology.TASKS]:
            self.bus.consume(name, self.on_task, prefetch=1)
        # Its own queue: the scheduler's launch and stop of a DDP group's rank on this learner, and the
        # tasks of clients whose state it keeps. Those wait unacked while a rank runs: a window wide
        # enough that a DdpStop never queues behind them.
        self.bus.consume(topology.learner_queue(self.name), self.on_control, prefetch=CONTROL_PREFETCH)
        self.bus.call_soon(self._heartbeat)
        log.info("learner_started", learner=self.name, device=str(self.device), sites=list(sites))

    def _heartbeat(self) -> None:
        """Tell the scheduler we are alive, and whether busy; re-armed on the bus thread."""
        if self._stopping:
            return  # it said goodbye (_leave): a beat now would bring it back to the table
        beat = Heartbeat(
            learner=self.name, node=self.node, replica=self.replica, device=str(self.device),
            busy=self._held > 0 or self.ddp.active, pid=os.getpid(),
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

    def close(self) -> None:
        """After the bus stopped: the fetched models' files go, and the client state it spilled (the
        aggregator keeps the durable copy)."""
        self.models.close()
        self.work.kept.close()

    def join(self, timeout: float | None = None) -> bool:
        """After shutdown(): wait for the training thread to end; False if it still trains."""
        if self._worker is not None:
            self._worker.join(timeout)
        return self._worker is None or not self._worker.is_alive()

    def on_task(self, delivery: Delivery) -> None:
        self.tasks_inbox.handle(delivery, self._take)

    def _take(self, msg: Message, delivery: Delivery) -> Handled:
        """A checked task, or a TrainTasks' tasks, to the training thread (which acks the delivery
        once every task's reply is confirmed)."""
        assert isinstance(msg, TrainTask | TrainTasks | EvalTask), "the tasks' inboxes take tasks only"
        tasks: list[Task] = list(msg.tasks()) if isinstance(msg, TrainTasks) else [msg]
        if delivery.redelivered:
            self.redelivered += 1
            log.info("task_redelivered", job=msg.job_id, round=msg.round, clients=[t.client for t in tasks])
        if len(tasks) > 1:
            delivery = SharedDelivery(delivery, len(tasks))
        with self._held_lock:
            self._held += len(tasks)
        self._tasks.put([(task, delivery) for task in tasks])
        return KEPT

    def on_control(self, delivery: Delivery) -> None:
        """The scheduler's DdpLaunch and DdpStop for this learner, and the tasks of clients whose
        state it keeps (learner/statecache.py)."""
        self.control_inbox.handle(delivery, self._control)

    def _control(self, msg: Message, delivery: Delivery) -> Handled:
        if isinstance(msg, TrainTask | TrainTasks):
            return self._take(msg, delivery)
        if isinstance(msg, DdpLaunch):
            self.ddp.launch(msg, self._check_entry)
        elif isinstance(msg, DdpStop):
            self.ddp.stop(msg)
        return None

    def _check_entry(self, entry: str) -> None:
        """As the scheduler did: a launch may have come another way (CodeNotAllowed fails the rank)."""
        self.work.allowed.check(entry.partition(":")[0], "entry", entry)

    def _work(self) -> None:
        waiting: list[tuple[Task, Delivery]] = []  # taken and not trained yet, in order
        while True:
            if not waiting:
                taken = self._tasks.get()
                if taken is None:
                    return
                waiting.extend(taken)
            if self._stopping:
                return
            item = waiting.pop(0)
            if isinstance(item[1], SharedDelivery) and item[1].doomed:
                self._settle(item[1], requeue=True)  # its message comes again whole: not trained here
                continue
            # In a DDP group: the task waits, unacked (prefetch: no other comes meanwhile); the
            # round's nudge sends it to another learner if the group outlasts the round.
            while self.ddp.active and not self._stopping:
                time.sleep(0.5)
            group = self._gather(item, waiting)
            if group is None:
                self._run(*item)
            else:
                self._run_group(group)

    def _gather(
        self, first: tuple[Task, Delivery], waiting: list[tuple[Task, Delivery]]
    ) -> list[tuple[TrainTask, Delivery]] | None:
        """`first` and the rest of its message (a TrainTasks) that train with it: one fused job, round
        and model, as many as one group message holds; None: `first` trains alone, as any task does.
        Others stay in `waiting`, in order."""
        task = first[0]
        try:
            if not isinstance(task, TrainTask) or not self.work.fusable(task):
                return None
        except Exception:  # its job cannot load here: `_run` says why, as for any task
            return None
        key = (task.job_id, task.round, task.model_digest)
        group: list[tuple[TrainTask, Delivery]] = [(task, first[1])]
        # Held till the group's message goes: no more updates than one message carries.
        limit = self.work.gather_limit(task, GROUP_MESSAGE_BYTES)
        rest, waiting[:] = list(waiting), []
        for item in rest:
            other = item[0]  # not another job's, round's, or a second copy of a client's (a nudge)
            if (len(group) < limit and isinstance(other, TrainTask)
                    and (other.job_id, other.round, other.model_digest) == key
                    and all(other.client != mine.client for mine, _ in group)):
                group.append((other, item[1]))
            else:
                waiting.append(item)
        return group

    def _run(self, task: Task, delivery: Delivery) -> None:
        # contextvars are per thread: bind here, where the work runs.
        with structlog.contextvars.bound_contextvars(job=task.job_id, round=task.round, client=task.client):
            try:
                reply = self._work_retrying(lambda: [self._do(task)])[0]
            except BrokerUnavailable as exc:
                # The broker's trouble, not the client's: the task goes back, nothing is reported.
                log.warning("task_returned", error=str(exc)[:300])
                self._settle(delivery, requeue=True)
                return
            except Exception as exc:
                reply = self._failed(task, exc)
            self._send(delivery, reply)

    def _run_group(self, group: list[tuple[TrainTask, Delivery]]) -> None:
        """Train a group's tasks together; then each task's reply is published and acked on its own."""
        tasks = [task for task, _ in group]
        with structlog.contextvars.bound_contextvars(job=tasks[0].job_id, round=tasks[0].round):
            try:
                outcomes = self._work_retrying(lambda: self.work.train_group(tasks))
            except BrokerUnavailable as exc:
                log.warning("tasks_returned", error=str(exc)[:300], count=len(group))
                for _, delivery in group:
                    self._settle(delivery, requeue=True)
                return
            except Exception as exc:  # the group's own work failed: each task says so
                outcomes = [exc] * len(group)
        together = [(update, delivery) for update, (_, delivery) in zip(outcomes, group, strict=True)
                    if isinstance(update, ClientUpdate) and groupable(update)]
        if len(together) < 2 or sum(encoded_nbytes(u.weights) for u, _ in together) > GROUP_MESSAGE_BYTES:
            together = []  # each goes on its own
        self._send_group(together)
        sent = {id(delivery) for _, delivery in together}
        for (task, delivery), outcome in zip(group, outcomes, strict=True):
            if id(delivery) in sent:
                continue
            with structlog.contextvars.bound_contextvars(job=task.job_id, round=task.round,
                                                         client=task.client):
                reply = ((topology.AGGREGATOR, to_wire(outcome)) if isinstance(outcome, ClientUpdate)
                         else self._failed(task, outcome))
                self._send(delivery, reply)

    def _send_group(self, updates: list[tuple[ClientUpdate, Delivery]]) -> None:
        """The group's updates in one message (common/groups.py); its tasks acked once it is confirmed."""
        if not updates or self._stopping:
            return  # the tasks go back to the queue with our connection
        try:
            self.bus.publish(topology.AGGREGATOR, to_wire(group_of([update for update, _ in updates])))
        except Exception as exc:
            log.warning("publish_failed", error=str(exc)[:300], count=len(updates))
            for _, delivery in updates:
                self._settle(delivery, requeue=True)
            return
        for _, delivery in updates:
            self._settle(delivery)

    def _failed(self, task: Task, exc: Exception) -> tuple[str, bytes]:
        """The ClientFailure a task's error makes, for the scheduler."""
        return topology.SCHEDULER, to_wire(client_failure(task, exc, self.name))

    def _send(self, delivery: Delivery, reply: tuple[str, Body]) -> None:
        """Publish a task's reply, then ack the task; a publish not confirmed returns the task."""
        if self._stopping:
            return  # the task goes back to the queue with our connection
        try:
            self.bus.publish(reply[0], reply[1])
        except Exception as exc:
            # Not confirmed, so not acked: the broker hands the task out again.
            log.warning("publish_failed", error=str(exc)[:300])
            self._settle(delivery, requeue=True)
            return
        self._settle(delivery)

    def _settle(self, delivery: Delivery, requeue: bool = False) -> None:
        with self._held_lock:
            self._held -= 1
        if requeue:
            delivery.requeue()
        else:
            delivery.ack()

    def _work_retrying(self, work: Callable[[], R]) -> R:
        """Train or evaluate; a model fetch lost to the broker is tried again after a backoff."""
        delay = self.settings.retry_initial_s
        for _ in range(FETCH_ATTEMPTS - 1):
            try:
                return work()
            except BrokerUnavailable as exc:
                if self._stopping:
                    raise
                log.warning("model_fetch_retry", error=str(exc)[:300], retry_in_s=round(delay, 2))
                time.sleep(delay)  # the training thread: the bus thread keeps the connection alive
                delay = min(delay * 2, self.settings.retry_max_s)
        return work()

    def _do(self, task: Task) -> tuple[str, Body]:
        """The reply a task gets: an EvalReport for the scheduler, a ClientUpdate for the aggregator.

        The update stays in its encoded parts, which view the trained model's tensors: it is sent
        chunk by chunk from them (no copy of the model). Nothing changes those tensors afterwards
        (Work.train: a copy, or the model's own lent until its next load replaces them), so the
        parts are owned: the in-memory bus hands them to the aggregator's thread unjoined."""
        if isinstance(task, EvalTask):
            return topology.SCHEDULER, to_wire(self.work.evaluate(task))
        update = to_wire_parts(self.work.train(task))
        update.owned = True
        return topology.AGGREGATOR, update

    def _fetch(self, job_id: str, digest: str) -> tuple[dict[str, torch.Tensor], int]:
        """A global model from the aggregator by digest (request/reply over the bus), and its size,
        in memory (a DDP rank's start)."""
        weights, size = self._fetch_model(job_id, digest, to_file=False)
        return dict(weights), size

    def _fetch_large(
        self, job_id: str, digest: str, downlink: Downlink = "none"
    ) -> tuple[Mapping[str, torch.Tensor], int]:
        """As `_fetch`; a model that came in chunks stays in a file of `self.models` (a TensorFile:
        read a tensor at a time), which the work cache deletes when it drops the model.

        With FEDMQ_SHARED_MODELS_DIR, a model another learner of this host fetched is read from
        there (0 bytes over the bus), and one fetched here is shared there; one learner at a time
        fetches a model, the others wait for it. A rounded model (compression.downlink) is not
        shared: its tensors no longer hash to the digest that would vouch for a neighbour's file."""
        if (self.shared is None or downlink != "none" or not self.shared.shares(digest)
                or job_id in self.shared.small):
            return self._fetch_model(job_id, digest, to_file=True, downlink=downlink)
        refused: tuple[int, ...] | None = None  # the shared file found not to be that model
        for _ in range(2):
            with self.shared.turn(digest):  # one learner of the host fetches it; the others wait, link it
                if refused is not None:
                    self.shared.discard(digest, refused)  # if no other learner has replaced it since
                try:
                    taken = self.shared.take(digest, self.models.path)
                except (OSError, ValueError) as exc:  # the folder's trouble, or not a file (gone): fetched
                    log.warning("shared_model_unreadable", digest=digest[:12], error=str(exc)[:300])
                    taken = None
                if taken is None:
                    return self._fetch_model(job_id, digest, to_file=True, share=True)
            own, refused = taken
            try:  # checked outside the turn: the host's learners check their links at once
                weights = self._model_file(own, digest, check=True)
            except (FedmqError, ValueError) as exc:  # not a whole model of that digest (DecodeError too)
                log.warning("shared_model_refused", digest=digest[:12], error=str(exc)[:300])
                continue
            except OSError as exc:  # this learner's trouble reading it (too many files open): fetched
                log.warning("shared_model_unreadable", digest=digest[:12], error=str(exc)[:300])
                return self._fetch_model(job_id, digest, to_file=True)
            self.metrics.models_shared.inc()
            return weights, 0
        return self._fetch_model(job_id, digest, to_file=True)  # refused twice: fetched for itself

    def _fetch_model(
        self, job_id: str, digest: str, to_file: bool, share: bool = False, downlink: Downlink = "none"
    ) -> tuple[Mapping[str, torch.Tensor], int]:
        """The model over the bus (rounded as `downlink` says) and its size; `share`: one that came
        in chunks (a file) is shared with this host's other learners first, and a job whose model
        came whole is remembered as having nothing to share."""
        request = to_wire(ModelGet(job_id=job_id, digest=digest, downlink=downlink))
        timeout = self.settings.request_timeout_s
        try:
            if to_file:
                folder = self.models.path  # made here, on the training thread, not on the bus's
                body = self.bus.request_large(topology.MODEL, request, timeout=timeout, spool=lambda: folder)
            else:
                body = self.bus.request(topology.MODEL, request, timeout=timeout)
        except Exception as exc:  # the transport's trouble, or this learner's disk: never the client's
            raise BrokerUnavailable(f"model fetch failed: {type(exc).__name__}: {exc}") from exc
        if isinstance(body, bytes):
            if share and self.shared is not None:
                self.shared.small.add(job_id)
            return self._model(from_wire(body, max_bytes=self.settings.max_message_bytes), digest), len(body)
        size = body.stat().st_size
        if share and self.shared is not None:
            try:
                self.shared.put(digest, body)
            except OSError as exc:  # the shared folder's trouble: this learner has its model
                log.warning("shared_model_unwritable", error=str(exc)[:300])
        return self._model_file(body, digest), size

    def _model_file(self, path: Path, digest: str, check: bool = False) -> Mapping[str, torch.Tensor]:
        """The model a ModelReply file holds (its tensors read from it on access when it is large;
        a small one is decoded whole and the file removed). `check`: its tensors must hash to
        `digest` (a file this learner did not fetch itself)."""
        try:
            weights = self._model(from_wire_file(path, max_bytes=self.settings.max_message_bytes), digest)
            if check and state_digest(weights) != digest:
                raise FedmqError(f"model {digest[:12]}: its tensors do not hash to its digest")
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        if not isinstance(weights, TensorFile):
            path.unlink(missing_ok=True)  # small enough to have been decoded whole
        else:
            large_buffers_unmapped()
        return weights

    @staticmethod
    def _model(msg: Message, digest: str) -> Mapping[str, torch.Tensor]:
        reply = expect(msg, ModelReply)
        if reply.error or reply.weights is None:
            raise FedmqError(f"model {digest[:12]} unavailable: {reply.error}")
        if reply.digest != digest:
            raise FedmqError(f"asked for model {digest[:12]}, got {reply.digest[:12]}")
        return reply.weights

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


