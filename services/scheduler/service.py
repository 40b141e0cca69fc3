"""Scheduler handlers: accept jobs, run each job's round loop, publish job events.

Control plane only: no torch. Ack policy: messages on fedmq.scheduler are acked
once their effect is published; undecodable ones and invalid job specs are
rejected (dead-lettered) with the reason, and a spec error also fails the job
visibly so `fedmq watch` can say why. A spec naming code outside the allow-list
(FEDMQ_ALLOWED_CODE) is such an error: refused before any service imports it.

The service holds three loops, each built on one SchedContext (context.py), which shares its
settings, bus, metrics, jobs, their rows and the learner registry:

    SchedulerService ─┬─ rounds      RoundLoop (loop.py)             rounds, tasks, deadlines
                      ├─ evaluation  EvaluationLoop (evaluation.py)  closed rounds, evaluation
                      └─ ddp         DdpLoop (ddp.py)                DDP groups

It decodes each message and hands it to the loop it concerns; its sweep calls `ddp.tick`.

Failures: a JobFailed (the aggregator's user code raised, or its spec failed) ends
the job with its reason; a ClientFailure carrying a user-code error ends it too,
naming client, round, phase, type and message, unless the job's
`clients.on_error` is `drop_client` (then the client only costs quorum). A job's
row that cannot be written (disk or database full) leaves its message unacked, to
be handled again after a backoff (stateretry).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import NoReturn

import structlog

from fedmq.common.allowlist import AllowList, CodeNotAllowed
from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.coderefs import check_code
from fedmq.common.errors import ConfigError, StateUnwritable, ValidationError
from fedmq.common.inbox import KEPT, GroupCommit, Handled, Inbox
from fedmq.common.jobspec import parse_job
from fedmq.common.messages import (
    ClientFailure,
    DdpExit,
    DdpProgress,
    DdpStored,
    EvalReport,
    Heartbeat,
    JobCancel,
    JobCreate,
    JobFailed,
    JobSubmit,
    Message,
    RoundClosed,
    StatusRequest,
    UpdateAccepted,
    UpdatesAccepted,
    to_wire,
)
from fedmq.common.metrics import Metrics, reason_label
from fedmq.common.senders import check_site_sender
from fedmq.common.settings import Settings
from fedmq.common.speclimits import SpecTooLarge
from fedmq.common.stateretry import StateRetry
from fedmq.services.scheduler.context import SchedContext
from fedmq.services.scheduler.ddp import DdpLoop, new_group
from fedmq.services.scheduler.evaluation import EvaluationLoop
from fedmq.services.scheduler.jobs import CANCELLED, FAILED, RUNNING, SchedJob
from fedmq.services.scheduler.limits import check_submission
from fedmq.services.scheduler.loop import RoundLoop, kept_checkpoints, round_close
from fedmq.services.scheduler.records import add_sync
from fedmq.services.scheduler.registry import Registry
from fedmq.services.scheduler.rounds import fails_job
from fedmq.services.scheduler.status import status_reply
from fedmq.services.scheduler.store import JobRows

log = structlog.get_logger("fedmq.scheduler")


class SchedulerService:
    def __init__(
        self, settings: Settings, bus: Bus, metrics: Metrics | None = None, allowed: AllowList | None = None
    ) -> None:
        self.settings = settings
        self.senders = settings.role_users
        self.bus = bus
        self.metrics = metrics or Metrics()
        self.allowed = allowed or AllowList.services(settings.allowed_prefixes)
        self.jobs: dict[str, SchedJob] = {}
        self.registry = Registry(master_node=settings.master_node)
        self.rows = JobRows(Path(settings.state_dir) / "scheduler" / "jobs.sqlite", settings.fsync)
        self.retry = StateRetry(bus, self.metrics, settings)
        self.inbox = Inbox(self.senders, settings.frame_bytes, service="scheduler", retry=self.retry)
        # The messages handled since the last save, acked once the jobs they changed are saved,
        # each job once for all of them (a group commit).
        self.saves: GroupCommit[SchedJob] = GroupCommit(bus, self.retry, self._save_jobs)
        self.ctx = SchedContext(
            settings, bus, self.metrics, self.jobs, self.rows, self.retry, self.registry,
            grace_until=time.monotonic() + 1.5 * settings.liveness_s,
        )
        # The round loop and the evaluation loop call each other: the round loop reaches the
        # evaluation loop, built just after it, through these two callbacks.
        self.rounds = RoundLoop(
            self.ctx,
            dispatch_eval=lambda job, at, clients: self.evaluation.dispatch(job, at, clients),
            advance_eval=lambda job: self.evaluation.advance(job),
        )
        self.evaluation = EvaluationLoop(self.ctx, self.rounds)
        self.ddp = DdpLoop(self.ctx)

    def start(self) -> None:
        self.rows.open()
        self._resume()
        self.bus.consume(topology.SCHEDULER, self.on_message, prefetch=8)
        self.bus.call_later(1.0, self._sweep)

    def learners_heard(self) -> None:
        """Every learner there is has beaten (an embedded cluster knows its own): sites without one
        are unserved from now on, not after the start-up grace."""
        self.ctx.grace_until = 0.0

    def _resume(self) -> None:
        """Pick every unfinished job up where the last process left it."""
        for fields in self.rows.load():
            job = SchedJob(**fields)
            self.jobs[job.job_id] = job
            if job.status != RUNNING:
                continue
            log.info("job_resumed", job=job.job_id, round=job.round)
            if job.spec.ddp is not None:  # its group goes on, or is launched again (DdpLoop.tick)
                if job.round == 0:
                    self.rounds.arm_start(job)
            elif job.state is None:
                # Created but its initial model never reported: ask again (duplicates are answered).
                self.bus.call_soon(functools.partial(self._republish_create, job))
                self.rounds.arm_start(job)
            else:
                self.rounds.arm_deadline(job)
                if job.evaluation is None and job.state.closing:
                    self.bus.call_soon(functools.partial(self._republish_close, job))

    def _republish_create(self, job: SchedJob) -> None:
        self.bus.publish(topology.AGGREGATOR, to_wire(JobCreate(job_id=job.job_id, spec=job.raw_spec)))

    def _republish_close(self, job: SchedJob) -> None:
        assert job.state is not None
        close = round_close(job.job_id, job.state, kept_checkpoints(job))
        self.bus.publish(topology.AGGREGATOR, to_wire(close))

    def _sweep(self) -> None:
        try:
            for name in self.registry.sweep(time.monotonic()):
                log.warning("learner_lost", learner=name, alive=self.registry.alive_count)
                self.rounds.redispatch_held(name)
            self._gauge_fleet()
            self.ddp.tick()
        finally:
            self.bus.call_later(1.0, self._sweep)

    def on_message(self, delivery: Delivery) -> None:
        self.inbox.handle(delivery, self._dispatch)

    def _dispatch(self, msg: Message, delivery: Delivery) -> Handled:
        """The message to the loop it concerns; KEPT: acked once its job's row is saved."""
        if isinstance(msg, Heartbeat | StatusRequest):
            self._answer(msg, delivery)
            return None
        with structlog.contextvars.bound_contextvars(job=msg.job_id, round=getattr(msg, "round", None)):
            self._handle(msg, delivery.user_id)
        job = self.jobs.get(msg.job_id)
        if job is None:
            self.retry.succeeded()
            return None
        self.saves.add(delivery, job)  # handled again after a failed save: handlers are idempotent
        return KEPT

    def _save_jobs(self, jobs: list[SchedJob]) -> None:
        """Each job the messages changed, once; StateUnwritable: tried again after the backoff."""
        for job in {job.job_id: job for job in jobs}.values():
            try:
                self.rows.save(job)
            except StateUnwritable:
                raise
            except Exception:  # a bug, not the disk: it would fail every time; the others go on
                log.exception("job_save_crashed", job=job.job_id)

    def _count_update(self, job: SchedJob, msg: UpdateAccepted) -> None:
        """Count a client's stored update in its round, once."""
        state = job.state
        if state is None or state.round != msg.round:
            return
        if state.record_update(msg.client, msg.num_examples, msg.learner, msg.state_tag):
            add_sync(job.sync, msg)

    def _gauge_fleet(self) -> None:
        self.metrics.learners_alive.set(self.registry.alive_count)
        self.metrics.learners_busy.set(self.registry.busy_count)
        self.metrics.tasks_in_flight.set(sum(
            len(j.state.missing) for j in self.jobs.values()
            if j.status == RUNNING and j.state is not None and not j.state.closing
        ))

    def _answer(self, msg: Heartbeat | StatusRequest, delivery: Delivery) -> None:
        now = time.monotonic()
        if isinstance(msg, Heartbeat):
            if msg.leaving:
                self.registry.forget(msg.learner)
                log.info("learner_left", learner=msg.learner, alive=self.registry.alive_count)
                self.rounds.redispatch_held(msg.learner)
                return
            bound = self.settings.users_of_sites  # a learner hosts only the sites its user may serve
            sites = [s for s in msg.sites if s not in bound or delivery.user_id in bound[s]]
            if sites != msg.sites:
                log.warning("heartbeat_sites_refused", learner=msg.learner,
                            sites=sorted(set(msg.sites) - set(sites)), user=delivery.user_id)
                msg = msg.model_copy(update={"sites": sites})
            if self.registry.heartbeat(msg, now):
                log.info("learner_joined", learner=msg.learner, device=msg.device,
                         alive=self.registry.alive_count)
            return
        self.bus.reply(delivery, to_wire(status_reply(msg, self.jobs, self.registry, now)))

    def _handle(self, msg: Message, user_id: str | None = None) -> None:
        if isinstance(msg, JobSubmit):
            self.submit(msg)
            return
        job = self.jobs.get(msg.job_id)
        if job is None:
            raise ValidationError("unknown_job", msg.job_id)
        if job.status != RUNNING:
            log.info("ignored_finished_job", type=msg.type)  # type: ignore[attr-defined]
            return
        if isinstance(msg, EvalReport | ClientFailure) and msg.client < job.spec.clients.total:
            check_site_sender(job.spec.clients.site(msg.client), user_id, self.settings.users_of_sites)
        match msg:
            case RoundClosed():
                self.evaluation.round_closed(job, msg)
            case UpdateAccepted() | UpdatesAccepted():
                for update in msg.updates if isinstance(msg, UpdatesAccepted) else [msg]:
                    self._count_update(job, update)
                # Even when every client was counted already: this message may be one redelivered
                # because the RoundClose it led to was not confirmed (the broker closed the connection).
                if job.state is not None and job.state.round == msg.round and not job.state.closing:
                    if isinstance(msg, UpdatesAccepted) and msg.closed:
                        self.rounds.closed_by_aggregator(job)
                    else:
                        self.rounds.advance(job)
            case EvalReport():
                self.evaluation.eval_report(job, msg)
            case ClientFailure() if msg.error is not None and fails_job(msg, job.spec.clients.on_error):
                log.warning("client_user_code_failed", client=msg.client, phase=msg.error.phase)
                self.metrics.client_failures.labels(reason_label(msg.code)).inc()
                self.ctx.finish(job, FAILED, msg.error.line(), error=msg.error.model_dump())
            case ClientFailure() if job.evaluation is not None and job.evaluation.round == msg.round:
                log.warning("client_failed", client=msg.client, code=msg.code, reason=msg.reason)
                job.evaluation.record_client_failure(msg, training=False)
                self.evaluation.advance(job)
            case ClientFailure():
                if job.state and job.state.round == msg.round:
                    log.warning("client_failed", client=msg.client, code=msg.code, reason=msg.reason)
                    self.metrics.client_failures.labels(reason_label(msg.code)).inc()
                    job.state.record_client_failure(msg)
                    self.rounds.advance(job)
            case DdpExit():
                self.ddp.exited(job, msg)
            case DdpProgress():
                self.ddp.progress(job, msg)
            case DdpStored():
                self.ddp.stored(job, msg)
            case JobFailed():
                error = None if msg.error is None else msg.error.model_dump()
                self.ctx.finish(job, FAILED, msg.reason, error=error)
            case JobCancel():
                self.ctx.finish(job, CANCELLED, msg.reason)
            case _:
                raise ValidationError("unexpected_type", msg.type)  # type: ignore[attr-defined]

    # -- job lifecycle ----------------------------------------------------------

    def submit(self, msg: JobSubmit) -> None:
        if msg.job_id in self.jobs:
            log.info("job_submit_duplicate")
            return
        try:
            spec = parse_job(msg.spec)
            check_code(spec, self.allowed)  # before any service imports what the spec names
        except CodeNotAllowed as exc:
            log.warning("job_code_refused", what=exc.what, module=exc.module)
            self.metrics.refused_code(exc.what)
            self.ctx.event(msg.job_id, "failed", data={"reason": str(exc)})
            raise ValidationError("code_not_allowed", str(exc)) from None
        except SpecTooLarge as exc:
            self._refuse(msg, exc.limit, str(exc))
        except ConfigError as exc:
            self.ctx.event(msg.job_id, "failed", data={"reason": str(exc)})
            raise ValidationError("invalid_spec", str(exc)) from None
        running = sum(job.status == RUNNING for job in self.jobs.values())
        refusal = check_submission(spec, self.settings, running)
        if refusal is not None:
            self._refuse(msg, refusal.limit, refusal.message)
        # Publish before remembering: if the publish fails, the redelivered JobSubmit starts over.
        if spec.ddp is None:  # a DDP job has no model until its rank 0 sends one
            self.bus.publish(topology.AGGREGATOR, to_wire(JobCreate(job_id=msg.job_id, spec=msg.spec)))
        job = SchedJob(msg.job_id, spec, msg.spec, accepted_at=time.time(), holders={})
        self.jobs[msg.job_id] = job
        if spec.ddp is not None:
            job.group = new_group(job)
        self.rounds.arm_start(job)
        objective = None if spec.objective is None else spec.objective.model_dump()
        data = {"name": spec.name, "objective": objective}
        self.ctx.event(job.job_id, "accepted", rounds=spec.rounds, data=data)
        log.info("job_accepted", name=spec.name, rounds=spec.rounds, clients=spec.clients.total)

    def _refuse(self, msg: JobSubmit, limit: str, reason: str) -> NoReturn:
        """A submission past a limit: the job fails visibly, the message is dead-lettered, both counted."""
        log.warning("job_refused", limit=limit, reason=reason[:500])
        self.metrics.refused(limit)
        self.ctx.event(msg.job_id, "failed", data={"reason": reason, "limit": limit})
        raise ValidationError("over_limit", reason)
