"""Embedded mode: scheduler, aggregator and learners as threads on one in-memory bus.

This module is the composition root for one process; `fedmq <service>` is the
composition root for separate processes. Same services, same handlers.

A cluster stops in order: learners take no more tasks and finish (and drop) the one they
train while the aggregator still serves them weights; then every bus stops and its thread is
joined, so no torch op still runs when the process exits (a stop by Ctrl-C, a
KeyboardInterrupt out of the `with` block, waits as long as that takes). Left by an
exception, it keeps what its in-memory queues held in the state directory (`pause`) for
`run_job(..., resume=True)`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import structlog

from fedmq.common import statefiles
from fedmq.common.allowlist import AllowList
from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.bus.factory import MemoryBuses
from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import JobEvent, JobSubmit, StatusReply, StatusRequest, expect, from_wire, to_wire
from fedmq.common.settings import Settings
from fedmq.services.aggregator.service import AggregatorService
from fedmq.services.cli import pause
from fedmq.services.cli.follow import TERMINAL, JobFollower
from fedmq.services.cli.interrupt import Interrupt
from fedmq.services.cli.summary import summarize
from fedmq.services.learner.service import LearnerService
from fedmq.services.scheduler.service import SchedulerService

log = structlog.get_logger("fedmq.run")

STOP_WAIT_S = 10.0  # a stop at the end of a job waits this long per thread; a Ctrl-C waits for all
STATUS_TIMEOUT_S = 30.0


class EmbeddedCluster:
    """All services of fedmq in this process; use as a context manager."""

    def __init__(
        self, settings: Settings, learners: int = 1, connect: Callable[[str], Bus] | None = None,
        allowed: AllowList | None = None,
    ) -> None:
        """`allowed`: the code its services may import for a job (default: the services' list,
        fedmq's built-ins and FEDMQ_ALLOWED_CODE; `fedmq run` passes AllowList.project)."""
        self.settings = settings
        memory = MemoryBuses(settings)
        self.broker = memory.broker
        self.in_memory = connect is None
        self._connect = connect or memory.connect
        self.allowed = allowed or AllowList.services(settings.allowed_prefixes)
        self.scheduler = SchedulerService(settings, self._connect("scheduler"), allowed=self.allowed)
        self.aggregator = AggregatorService(settings, self._connect("aggregator"), allowed=self.allowed)
        self.learners = [
            LearnerService(settings, self._connect(f"learner-{i}"), replica=i, allowed=self.allowed)
            for i in range(learners)
        ]
        self._threads: list[threading.Thread] = []

    def connect(self, name: str = "client") -> Bus:
        """A bus for a client of the cluster (the CLI, a test), on the same transport."""
        return self._connect(name)

    def __enter__(self) -> EmbeddedCluster:
        import torch

        # All services share this process's cores: torch's default of one thread per core
        # per caller makes the learners' and the aggregator's thread teams fight (measured:
        # 2x slower rounds on 2 cores). Give each learner its share unless told otherwise.
        cores = os.cpu_count() or 1
        torch.set_num_threads(self.settings.torch_threads or max(1, cores // (len(self.learners) + 1)))
        try:
            for name, service in self.services():
                service.bus.on_dead_letter = service.metrics.dead_letter
                service.start()
                thread = threading.Thread(target=service.bus.run, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
            self._await_heartbeats()
        except BaseException:
            self.stop()  # what did start
            raise
        return self

    def _await_heartbeats(self) -> None:
        """The scheduler has heard every learner of this cluster: it may then count a site no
        learner hosts as unserved at once (else only after its start-up grace)."""
        deadline = time.monotonic() + 1.5 * self.settings.liveness_s
        mine = {learner.name for learner in self.learners}  # on a shared broker others may beat too
        while not mine <= {row.learner for row in self.scheduler.registry.alive()}:
            if time.monotonic() > deadline:
                return  # slow to start: the grace covers it
            time.sleep(0.005)
        self.scheduler.learners_heard()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        self.stop(wait=None if interrupted else STOP_WAIT_S)
        stopped = not any(thread.is_alive() for thread in self._threads)
        if exc_type is not None and self.in_memory and stopped:  # a job may go on: keep its messages
            pause.save(self.settings.state_dir, self.broker)

    def stop(self, wait: float | None = STOP_WAIT_S) -> None:
        """Learners first, while the rest still serve them; then every bus; each thread joined."""
        for learner in self.learners:
            learner.shutdown()
        for learner in self.learners:
            learner.join(wait)
        for _, service in self.services():
            service.bus.stop()
        for thread in self._threads:
            thread.join(wait)
        for learner in self.learners:
            learner.close()
        statefiles.wait_discarded(wait)  # the aggregator's deletions of closed rounds' files

    def services(self) -> list[tuple[str, SchedulerService | AggregatorService | LearnerService]]:
        return [
            ("scheduler", self.scheduler),
            ("aggregator", self.aggregator),
            *[(f"learner-{i}", learner) for i, learner in enumerate(self.learners)],
        ]


def run_job(
    spec: JobSpec,
    settings: Settings,
    *,
    learners: int = 1,
    connect: Callable[[str], Bus] | None = None,
    job_id: str | None = None,
    resume: bool = False,
    on_event: Callable[[JobEvent], None] | None = None,
    idle_timeout: float | None = None,
    interrupt: Interrupt | None = None,
    allowed: AllowList | None = None,
) -> dict[str, Any]:
    """Train `spec` to the end in this process; returns status, per-round history and model.

    `allowed`: the code the services may import (see EmbeddedCluster). With `resume`, job
    `job_id` goes on from its state in `settings.state_dir` (and from what a Ctrl-C kept there);
    `on_event` first hears the rounds it had done. With `interrupt`, Ctrl-C stops the run in
    order and raises KeyboardInterrupt.
    """
    if resume and job_id is None:
        raise ValueError("resuming needs the job id")
    job_id = job_id or new_job_id(spec)
    paused = pause.load(settings.state_dir) if resume and connect is None else None
    if paused is not None:  # before the scheduler reads its rounds: the pause took no round time
        pause.shift_deadlines(settings.state_dir, time.time() - paused.paused_at)
    if spec.ddp is not None:  # one learner per rank (each runs its rank as a child process)
        learners = max(learners, spec.ddp.world_size)
    if spec.clients.sites is not None and not settings.site_names:
        # One process plays every site: its learners host them all, reading FEDMQ_DATA_DIR.
        settings = settings.model_copy(update={"sites": ",".join(spec.clients.sites)})
    rounds: dict[int, dict[str, Any]] = {}
    final: dict[str, Any] = {"status": "unknown"}
    started = time.perf_counter()
    if connect is None and "fsync" not in settings.model_fields_set:
        # One process on an in-memory bus: a crash loses the bus's messages whatever is on disk, and
        # a killed process still leaves whole files; fsyncs would only slow every update down.
        settings = settings.model_copy(update={"fsync": False})
    if spec.train.fuse is not False and "fuse_clients" not in settings.model_fields_set:
        # One process: each learner takes its share of a round's tasks at once, to train together.
        settings = settings.model_copy(update={"fuse_clients": -(-spec.clients.sampled // learners)})
    with EmbeddedCluster(settings, learners=learners, connect=connect, allowed=allowed) as cluster:
        follower = JobFollower(cluster.connect(), job_id).start()
        if interrupt is not None:
            interrupt.attach(follower)
        try:
            if paused is not None:
                paused.replay(cluster.broker)
            events: Iterable[JobEvent] = follower.events(idle_timeout=idle_timeout)
            if resume:
                so_far = _story_so_far(follower.bus, job_id)
                events = so_far if so_far[-1].kind in TERMINAL else itertools.chain(so_far, events)
            else:
                submit = JobSubmit(job_id=job_id, spec=spec.model_dump(mode="json"))
                follower.bus.publish(topology.SCHEDULER, to_wire(submit))
            last = None
            for event in events:
                if on_event is not None:
                    on_event(event)
                if event.kind == "round_completed" and event.round is not None:
                    rounds[event.round] = dict(event.data)
                elif event.kind in TERMINAL:
                    final, last = {"status": event.kind, **event.data}, event.round
            done = last + (final["status"] == "completed") if last is not None else 0
            if spec.ddp is None and not set(range(done)) <= set(rounds):
                # Events are best effort: one published while a broker connection was being made
                # again is lost. The scheduler's record of the rounds is not.
                _fill_in(rounds, follower.bus, job_id)
        finally:
            follower.close()
        counters = {
            "model_fetches": [learner.fetches for learner in cluster.learners],
            "tasks_redelivered": sum(learner.redelivered for learner in cluster.learners),
            "fused_groups": [size for learner in cluster.learners for size in learner.work.fused_groups],
            "reconnects": sum(getattr(s.bus, "reconnects", 0) for _, s in cluster.services()),
            "dead_letters": _merge([s.metrics.dead_letter_counts() for _, s in cluster.services()]),
            "updates_rejected": _merge([s.metrics.rejected_update_counts() for _, s in cluster.services()]),
            "jobs_refused": _merge([s.metrics.refused_counts() for _, s in cluster.services()]),
        }
    history = [rounds[r] for r in sorted(rounds)]
    return {
        **counters,
        "job_id": job_id,
        "name": spec.name,
        "ddp": spec.ddp is not None,
        "wall_seconds": time.perf_counter() - started,
        **final,
        **summarize(history, None if spec.objective is None else spec.objective.model_dump()),
        "history": history,
    }


def _fill_in(rounds: dict[int, dict[str, Any]], bus: Bus, job_id: str) -> None:
    """The rounds whose events were missed, from the scheduler's record (kept as heard if it
    cannot be asked)."""
    try:
        told = _story_so_far(bus, job_id)
    except (TimeoutError, ConnectionError, ConfigError) as exc:
        log.warning("history_incomplete", job=job_id, rounds_heard=len(rounds), error=str(exc)[:200])
        return
    for event in told:
        if event.kind == "round_completed" and event.round is not None:
            rounds.setdefault(event.round, dict(event.data))


def _story_so_far(bus: Bus, job_id: str) -> list[JobEvent]:
    """A resumed job's events until now, told again from the scheduler's record of it."""
    request = to_wire(StatusRequest(job_id=job_id, what="job"))
    reply = expect(from_wire(bus.request(topology.SCHEDULER, request, timeout=STATUS_TIMEOUT_S)), StatusReply)
    if reply.error or not reply.jobs:
        raise ConfigError(f"cannot resume: {reply.error or job_id}")
    job = reply.jobs[0]
    events = [JobEvent(job_id=job_id, kind="accepted", rounds=job["rounds"], data={"name": job["name"]})]
    events += [JobEvent(job_id=job_id, kind="round_completed", round=h["round"], data=h)
               for h in job.get("history", [])]
    if job["status"] in TERMINAL:
        data = {k: job[k] for k in ("reason", "model_path") if job.get(k) is not None}
        events.append(JobEvent(job_id=job_id, kind=job["status"], round=job["round"], data=data))
    return events


def _merge(counts: list[dict[str, float]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in counts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + int(value)
    return out


def new_job_id(spec: JobSpec) -> str:
    return f"{spec.name}-{uuid.uuid4().hex[:8]}"
