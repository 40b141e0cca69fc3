"""Scheduler handlers: accept jobs, run each job's round loop, publish job events.

Control plane only: no torch. Ack policy: messages on fedmq.scheduler are acked
once their effect is published; undecodable ones and invalid job specs are
rejected (dead-lettered) with the reason, and a spec error also fails the job
visibly so `fedmq watch` can say why.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import structlog

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.errors import ConfigError, DecodeError, ValidationError
from fedmq.common.jobspec import parse_job
from fedmq.common.messages import (
    ClientFailure,
    EvalReport,
    EvalTask,
    EventKind,
    Heartbeat,
    JobCancel,
    JobCreate,
    JobEvent,
    JobFailed,
    JobSubmit,
    Message,
    RoundClose,
    RoundClosed,
    RoundOpen,
    StatusRequest,
    TrainTask,
    UpdateAccepted,
    from_wire,
    to_wire,
)
from fedmq.common.metrics import Metrics, reason_label
from fedmq.common.settings import Settings
from fedmq.services.scheduler.evaluation import (
    better,
    combine_reports,
    eval_clients,
    federated_due,
    round_record,
)
from fedmq.services.scheduler.jobs import CANCELLED, COMPLETED, FAILED, RUNNING, SchedJob
from fedmq.services.scheduler.registry import Registry
from fedmq.services.scheduler.rounds import Decision, RoundState
from fedmq.services.scheduler.sampling import sample_clients
from fedmq.services.scheduler.status import status_reply
from fedmq.services.scheduler.store import JobRows

log = structlog.get_logger("fedmq.scheduler")

NUDGE_BEFORE = 0.2  # re-dispatch missing tasks when this share of the round's time is left


class SchedulerService:
    def __init__(self, settings: Settings, bus: Bus, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.bus = bus
        self.metrics = metrics or Metrics()
        self.jobs: dict[str, SchedJob] = {}
        self.registry = Registry(master_node=settings.master_node)
        self.rows = JobRows(Path(settings.state_dir) / "scheduler" / "jobs.sqlite")

    def start(self) -> None:
        self.rows.open()
        self._resume()
        self.bus.consume(topology.SCHEDULER, self.on_message, prefetch=8)
        self.bus.call_later(1.0, self._sweep)

    def _resume(self) -> None:
        """Pick every unfinished job up where the last process left it."""
        for fields in self.rows.load():
            job = SchedJob(**fields)
            self.jobs[job.job_id] = job
            if job.status != RUNNING:
                continue
            log.info("job_resumed", job=job.job_id, round=job.round)
            if job.state is None:
                # Created but its initial model never reported: ask again (duplicates are answered).
                self.bus.call_soon(functools.partial(self._republish_create, job))
            else:
                self._arm_deadline(job)
                if job.evaluation is None and job.state.closing:
                    self.bus.call_soon(functools.partial(self._republish_close, job))

    def _republish_create(self, job: SchedJob) -> None:
        self.bus.publish(topology.AGGREGATOR, to_wire(JobCreate(job_id=job.job_id, spec=job.raw_spec)))

    def _republish_close(self, job: SchedJob) -> None:
        assert job.state is not None
        close = RoundClose(job_id=job.job_id, round=job.state.round, clients=sorted(job.state.reported))
        self.bus.publish(topology.AGGREGATOR, to_wire(close))

    def _sweep(self) -> None:
        try:
            for name in self.registry.sweep(time.monotonic()):
                log.warning("learner_lost", learner=name, alive=self.registry.alive_count)
            self._gauge_fleet()
        finally:
            self.bus.call_later(1.0, self._sweep)

    def on_message(self, delivery: Delivery) -> None:
        try:
            msg = from_wire(delivery.body, max_bytes=self.settings.frame_bytes)
            if isinstance(msg, Heartbeat | StatusRequest):
                self._answer(msg, delivery)
                delivery.ack()
                return
            with structlog.contextvars.bound_contextvars(job=msg.job_id, round=getattr(msg, "round", None)):
                self._handle(msg)
            if msg.job_id in self.jobs:
                self.rows.save(self.jobs[msg.job_id])  # durable before the ack
        except (DecodeError, ValidationError) as exc:
            reason = exc.reason if isinstance(exc, ValidationError) else "decode"
            log.warning("message_rejected", reason=reason, detail=str(exc)[:500])
            delivery.reject(str(exc) if isinstance(exc, ValidationError) else f"decode: {exc}")
            return
        delivery.ack()

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
            if self.registry.heartbeat(msg, now):
                log.info("learner_joined", learner=msg.learner, device=msg.device,
                         alive=self.registry.alive_count)
            return
        self.bus.reply(delivery, to_wire(status_reply(msg, self.jobs, self.registry, now)))

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, JobSubmit):
            self.submit(msg)
            return
        job = self.jobs.get(msg.job_id)
        if job is None:
            raise ValidationError("unknown_job", msg.job_id)
        if job.status != RUNNING:
            log.info("ignored_finished_job", type=msg.type)  # type: ignore[attr-defined]
            return
        match msg:
            case RoundClosed():
                self.round_closed(job, msg)
            case UpdateAccepted():
                if job.state and job.state.round == msg.round and job.state.record_update(msg.client, msg.num_examples):
                    for key, value in (("train_seconds", msg.train_seconds), ("fetch_seconds", msg.fetch_seconds),
                                       ("bytes_up", msg.bytes), ("bytes_down", msg.fetch_bytes)):
                        job.sync[key] = job.sync.get(key, 0.0) + value
                    self._advance(job)
            case EvalReport():
                self.eval_report(job, msg)
            case ClientFailure():
                if job.evaluation is not None and job.evaluation.round == msg.round:
                    log.warning("client_failed", client=msg.client, code=msg.code, reason=msg.reason)
                    job.evaluation.record_failure(msg.client, f"{msg.code}: {msg.reason}")
                    self._advance_evaluation(job)
                elif job.state and job.state.round == msg.round:
                    log.warning("client_failed", client=msg.client, code=msg.code, reason=msg.reason)
                    self.metrics.client_failures.labels(reason_label(msg.code)).inc()
                    job.state.record_failure(msg.client, f"{msg.code}: {msg.reason}")
                    self._advance(job)
            case JobFailed():
                self._finish(job, FAILED, msg.reason)
            case JobCancel():
                self._finish(job, CANCELLED, msg.reason)
            case _:
                raise ValidationError("unexpected_type", msg.type)  # type: ignore[attr-defined]

    # -- job lifecycle ----------------------------------------------------------

    def submit(self, msg: JobSubmit) -> None:
        if msg.job_id in self.jobs:
            log.info("job_submit_duplicate")
            return
        try:
            spec = parse_job(msg.spec)
        except ConfigError as exc:
            self._event(msg.job_id, "failed", data={"reason": str(exc)})
            raise ValidationError("invalid_spec", str(exc)) from None
        # Publish before remembering: if the publish fails, the redelivered JobSubmit starts over.
        self.bus.publish(topology.AGGREGATOR, to_wire(JobCreate(job_id=msg.job_id, spec=msg.spec)))
        job = SchedJob(msg.job_id, spec, msg.spec)
        self.jobs[msg.job_id] = job
        objective = None if spec.objective is None else spec.objective.model_dump()
        self._event(job.job_id, "accepted", rounds=spec.rounds, data={"name": spec.name, "objective": objective})
        log.info("job_accepted", name=spec.name, rounds=spec.rounds, clients=spec.clients.total)

    def round_closed(self, job: SchedJob, msg: RoundClosed) -> None:
        if msg.round != job.round or job.evaluation is not None:
            log.info("round_closed_duplicate", closed=msg.round)
            return
        if job.state is not None and job.state.round == msg.round and not job.state.closing:
            log.warning("round_closed_unasked", closed=msg.round)  # not ours to take: wait for quorum
            return
        if job.history and job.history[-1]["round"] == msg.round:
            log.info("round_closed_duplicate", closed=msg.round)
            return
        job.model_digest = msg.model_digest
        state = job.state
        record = round_record(
            msg, job.sync, clients=len(state.reported) if state else 0, failed=len(state.failed) if state else 0,
            seconds=time.monotonic() - state.started if state else 0.0,
        )
        if federated_due(job.spec, msg.round):
            self.start_evaluation(job, record)
        else:
            self._complete_round(job, record)

    def _complete_round(self, job: SchedJob, record: dict[str, Any]) -> None:
        """The round's record is whole: keep it, tell watchers, then the next round or the end."""
        job.history.append(record)
        best = better(job.spec, record, job.best)
        if best is not None:
            job.best = best
        self._event(job.job_id, "round_completed", round=record["round"], data=record)
        self._gauge_round(job, record)
        if record["round"] >= job.spec.rounds:
            self._finish(job, COMPLETED, "", model_path=record.get("model_path"), best=job.best)
        else:
            self.start_round(job, record["round"] + 1)

    def start_evaluation(self, job: SchedJob, record: dict[str, Any]) -> None:
        """Sampled clients evaluate the round's new model; the round completes when they have."""
        fed = job.spec.evaluate.federated
        assert fed is not None
        clients = eval_clients(job.spec, record["round"])
        self._dispatch_eval(job, record["round"], clients)
        job.pending, job.eval_reports = record, {}
        job.evaluation = RoundState(
            round=record["round"], clients=clients, quorum=min(fed.quorum, len(clients)),
            deadline=time.monotonic() + job.spec.round_timeout_s, retries_left=job.spec.max_round_retries,
            started=time.monotonic(),
        )
        self._arm_deadline(job)

    def eval_report(self, job: SchedJob, msg: EvalReport) -> None:
        evaluation = job.evaluation
        if evaluation is None or evaluation.round != msg.round:
            log.info("eval_report_stale", reported=msg.round)
            return
        if evaluation.record_update(msg.client, msg.num_examples):
            job.eval_reports[msg.client] = {
                "num_examples": msg.num_examples, "metrics": msg.metrics, "reduction": msg.reduction,
            }
            self._advance_evaluation(job)

    def _advance_evaluation(self, job: SchedJob) -> None:
        evaluation, record = job.evaluation, job.pending
        assert evaluation is not None and record is not None
        decision = evaluation.decide(time.monotonic())
        if decision is Decision.WAIT:
            return
        if decision is Decision.RETRY:
            self._dispatch_eval(job, evaluation.round, evaluation.missing)
            evaluation.retry(time.monotonic() + job.spec.round_timeout_s)
            self._arm_deadline(job)
            return
        if decision is Decision.CLOSE:
            record["metrics"]["federated"] = combine_reports(job.eval_reports)
        else:  # below quorum with no retries left: the round goes on without federated metrics
            log.warning("evaluation_below_quorum", reported=len(evaluation.reported), quorum=evaluation.quorum)
        record["evaluated_by"] = len(evaluation.reported)
        job.evaluation, job.pending, job.eval_reports = None, None, {}
        self._cancel_timers(job)
        self._complete_round(job, record)

    def _gauge_round(self, job: SchedJob, record: dict[str, Any]) -> None:
        m = self.metrics
        m.current_round.labels(job.job_id).set(record["round"])
        if "federated" in record["metrics"]:  # the aggregator exports the sources it computes
            m.round_metrics(job.job_id, {"federated": record["metrics"]["federated"]})
        if record["round"] > 0:
            m.rounds_completed.labels(job.job_id).inc()
            m.round_duration.observe(record.get("seconds", 0.0))

    def start_round(self, job: SchedJob, server_round: int) -> None:
        """Open a round. Everything is published before the job's state moves on, so a
        publish that fails leaves the RoundClosed that started it to be redelivered and
        handled again (the aggregator and learners take the repeats as duplicates)."""
        spec = job.spec
        clients = sample_clients(spec.seed, server_round, spec.clients.total, spec.clients.sampled)
        self.bus.publish(
            topology.AGGREGATOR,
            to_wire(RoundOpen(job_id=job.job_id, round=server_round, clients=clients)),
        )
        self._dispatch(job, server_round, clients)
        job.round, job.sync = server_round, {}
        job.state = RoundState(
            round=server_round,
            clients=clients,
            quorum=spec.clients.quorum,
            deadline=time.monotonic() + spec.round_timeout_s,
            retries_left=spec.max_round_retries,
            started=time.monotonic(),
        )
        self._arm_deadline(job)
        self._event(job.job_id, "round_started", round=server_round, data={"clients": len(clients)})

    def _dispatch(self, job: SchedJob, server_round: int, clients: list[int]) -> None:
        for client in clients:
            task = TrainTask(
                job_id=job.job_id,
                task_id=f"{job.job_id}:{server_round}:{client}",
                round=server_round,
                client=client,
                model_digest=job.model_digest,
                spec=job.raw_spec,
            )
            self.bus.publish(topology.TASKS, to_wire(task))

    def _dispatch_eval(self, job: SchedJob, server_round: int, clients: list[int]) -> None:
        for client in clients:
            task = EvalTask(
                job_id=job.job_id, task_id=f"{job.job_id}:e{server_round}:{client}", round=server_round,
                client=client, model_digest=job.model_digest, spec=job.raw_spec,
            )
            self.bus.publish(topology.TASKS, to_wire(task))

    def _cancel_timers(self, job: SchedJob) -> None:
        for timer in (job.timer, job.nudge):
            if timer is not None:
                timer.cancel()

    def _arm_deadline(self, job: SchedJob) -> None:
        self._cancel_timers(job)
        active = job.active
        assert active is not None
        delay = max(0.0, active.deadline - time.monotonic())
        server_round = active.round
        job.timer = self.bus.call_later(delay, lambda: self._on_deadline(job.job_id, server_round))
        # Near the deadline, tasks still missing go out again with the same ids: a learner that
        # froze (no broker redelivery yet) should not cost the round its quorum. Duplicates are ignored.
        nudge_in = delay - NUDGE_BEFORE * job.spec.round_timeout_s
        if nudge_in > 0:
            job.nudge = self.bus.call_later(nudge_in, lambda: self._on_nudge(job.job_id, server_round))

    def _on_nudge(self, job_id: str, server_round: int) -> None:
        job = self.jobs.get(job_id)
        active = job.active if job and job.status == RUNNING else None
        if job is None or active is None or active.round != server_round:
            return
        missing = [c for c in active.missing if c not in active.failed]
        if active.closing or not missing:
            return
        log.info("round_redispatch", round=server_round, missing=len(missing))
        self.metrics.tasks_redispatched.inc(len(missing))
        if job.evaluation is not None:
            self._dispatch_eval(job, server_round, missing)
        else:
            self._dispatch(job, server_round, missing)

    def _on_deadline(self, job_id: str, server_round: int) -> None:
        job = self.jobs.get(job_id)
        active = job.active if job and job.status == RUNNING else None
        if job is None or active is None or active.round != server_round:
            return
        if job.evaluation is not None:
            self._advance_evaluation(job)
        else:
            self._advance(job)
        self.rows.save(job)

    def _advance(self, job: SchedJob) -> None:
        state = job.state
        assert state is not None
        decision = state.decide(time.monotonic())
        if decision is Decision.CLOSE:
            clients = sorted(state.reported)
            if len(clients) < len(state.clients):
                self.metrics.rounds_closed_at_deadline.inc()
            log.info("round_closing", reported=len(clients), sampled=len(state.clients),
                     failed=len(state.failed))
            self.bus.publish(  # first: if it fails, the message that got us here comes again
                topology.AGGREGATOR,
                to_wire(RoundClose(job_id=job.job_id, round=state.round, clients=clients)),
            )
            state.closing = True
            self._cancel_timers(job)
        elif decision is Decision.RETRY:
            missing = state.missing
            log.warning("round_retry", missing=len(missing), retries_left=state.retries_left - 1)
            self.metrics.round_retries.inc()
            try:
                self._dispatch(job, state.round, missing)
            except Exception:
                # A timer has no message to be redelivered: try again shortly.
                job.timer = self.bus.call_later(1.0, lambda: self._on_deadline(job.job_id, state.round))
                raise
            state.retry(time.monotonic() + job.spec.round_timeout_s)
            self._arm_deadline(job)
        elif decision is Decision.FAIL:
            reasons = sorted(set(state.failed.values()))[:3]
            self._finish(job, FAILED, (
                f"round {state.round}: {len(state.reported)} of {len(state.clients)} clients "
                f"reported, quorum is {state.quorum}; failures: {reasons or 'timeouts'}"
            ))

    def _finish(self, job: SchedJob, status: str, reason: str, **data: Any) -> None:
        job.status, job.reason = status, reason
        self._cancel_timers(job)
        kind: EventKind = {COMPLETED: "completed", FAILED: "failed", CANCELLED: "cancelled"}[status]  # type: ignore[assignment]
        self._event(job.job_id, kind, round=job.round, data={"reason": reason, **data})
        log.info("job_finished", status=status, reason=reason)

    def _event(self, job_id: str, kind: EventKind, round: int | None = None,
               rounds: int | None = None, data: dict[str, Any] | None = None) -> None:
        event = JobEvent(job_id=job_id, kind=kind, round=round, rounds=rounds, data=data or {})
        self.bus.publish_event(topology.job_topic(job_id), to_wire(event))
