"""A closed round becomes a record: optionally after sampled clients evaluate its model.

    RoundClosed(r) ─▶ record ─┬─(federated evaluation due at r)─▶ EvalTask × k ─▶ EvalReports
                              │       (quorum, deadline and retries as in training)
                              │                                      ─▶ record.metrics.federated
                              └─▶ history, best round, event round_completed, round r + 1 or the end

A federated evaluation below its quorum with no retries left does not fail the job: the round's
record goes on without federated metrics (logged). SchedulerService holds one EvaluationLoop on the
shared SchedContext; it opens the next round through the RoundLoop it is given (and sends its tasks
and arms its deadlines with that loop's helpers), and that loop calls back `dispatch` and `advance`
when an evaluation's nudge or deadline comes.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from fedmq.common.messages import EvalReport, EvalTask, RoundClosed
from fedmq.services.scheduler.context import SchedContext, cancel_timers
from fedmq.services.scheduler.jobs import COMPLETED, SchedJob, note_holders
from fedmq.services.scheduler.loop import PUSH_MESSAGES_MAX, RoundLoop, with_model
from fedmq.services.scheduler.records import (
    add_eval_sync,
    better,
    eval_clients,
    evaluated,
    federated_due,
    report_entry,
    round_record,
)
from fedmq.services.scheduler.rounds import Decision, RoundState

log = structlog.get_logger("fedmq.scheduler")


class EvaluationLoop:
    """Closed rounds, their federated evaluation, the history and the best round."""

    def __init__(self, ctx: SchedContext, rounds: RoundLoop) -> None:
        self.ctx = ctx
        self.rounds = rounds

    def round_closed(self, job: SchedJob, msg: RoundClosed) -> None:
        if msg.round != job.round or job.evaluation is not None:
            log.info("round_closed_duplicate", closed=msg.round)
            return
        if job.state is not None and job.state.round == msg.round and not job.state.closing:
            if sorted(msg.clients) != sorted(job.state.clients):
                log.warning("round_closed_unasked", closed=msg.round)  # not ours to take: wait for quorum
                return
            # Every client folded: the aggregator closed the round itself (RoundOpen's
            # close_when_complete), and the announcement saying so was lost (it crashed, or its
            # publish failed, and the update that closed it came again). The close we would ask for.
            self.rounds.closed_by_aggregator(job)
        if self._recorded(job, msg.round):
            return
        state = job.state
        if state is not None:
            # What was folded is the round's: a client whose announcement never came (the
            # aggregator's own close, its announcement lost), or one a deadline's RoundClose left out
            # that the aggregator's close took first, reported.
            state.fold_in(msg.clients)
            note_holders(job, msg.clients, state)
        job.model_digest, job.config, job.model = msg.model_digest, dict(msg.config), msg.model
        if state is None:  # round 0: the initial model
            record = round_record(msg, job.sync, clients=0, failed=0, seconds=0.0)
        else:
            seconds = time.monotonic() - state.started
            record = round_record(msg, job.sync, len(state.reported), len(state.failed), seconds,
                                  state.unreported())
            unserved = [c for c, phase in state.phases.items() if phase == "placement"]
            if unserved:  # sites no live learner hosted: dropped clients, named in the history
                record["unserved_sites"] = sorted(str(job.spec.clients.site(c)) for c in unserved)
        if federated_due(job.spec, msg.round):
            self.start_evaluation(job, record)
        else:
            self._complete_round(job, record)

    def start_evaluation(self, job: SchedJob, record: dict[str, Any]) -> None:
        """Sampled clients evaluate the round's new model; the round completes when they have."""
        fed = job.spec.evaluate.federated
        assert fed is not None
        clients = eval_clients(job.spec, record["round"])
        unserved = self.dispatch(job, record["round"], clients)
        job.pending, job.eval_reports = record, {}
        job.evaluation = RoundState(
            round=record["round"], clients=clients, quorum=min(fed.quorum, len(clients)),
            deadline=time.monotonic() + job.spec.round_timeout_s, retries_left=job.spec.max_round_retries,
            started=time.monotonic(),
        )
        self.rounds.drop_unserved(job, job.evaluation, unserved)
        self.rounds.arm_deadline(job)

    def eval_report(self, job: SchedJob, msg: EvalReport) -> None:
        evaluation = job.evaluation
        if evaluation is None or evaluation.round != msg.round:
            if not self._recorded(job, msg.round):
                log.info("eval_report_stale", reported=msg.round)
            return
        if evaluation.record_update(msg.client, msg.num_examples):
            job.eval_reports[msg.client] = report_entry(msg)
            if job.pending is not None:  # the model a learner fetched to evaluate counts in the round's sync
                add_eval_sync(job.pending.setdefault("sync", {}), msg)
            self.advance(job)

    def advance(self, job: SchedJob) -> None:
        evaluation, record = job.evaluation, job.pending
        assert evaluation is not None and record is not None
        decision = evaluation.decide(time.monotonic())
        if decision is Decision.WAIT:
            return
        if decision is Decision.RETRY:
            unserved = self.dispatch(job, evaluation.round, evaluation.retryable)
            evaluation.retry(time.monotonic() + job.spec.round_timeout_s)
            self.rounds.drop_unserved(job, evaluation, unserved)
            self.rounds.arm_deadline(job)
            return
        if decision is Decision.CLOSE:
            record["metrics"].update(evaluated(job.eval_reports))
        else:  # below quorum with no retries left: the round goes on without federated metrics
            log.warning("evaluation_below_quorum", reported=len(evaluation.reported),
                        quorum=evaluation.quorum)
        record["evaluated_by"] = len(evaluation.reported)
        job.evaluation, job.pending, job.eval_reports = None, None, {}
        cancel_timers(job)
        self._complete_round(job, record)

    def dispatch(self, job: SchedJob, server_round: int, clients: list[int]) -> list[int]:
        unserved = self.rounds.unserved(job, clients)
        sent = [client for client in clients if client not in unserved]
        model = job.model if len(sent) <= PUSH_MESSAGES_MAX else b""  # one message a client
        self.ctx.bus.publish_all([
            (self.rounds.task_queue(job, client), with_model(EvalTask(
                job_id=job.job_id, task_id=f"{job.job_id}:e{server_round}:{client}", round=server_round,
                client=client, model_digest=job.model_digest, spec=job.raw_spec,
            ), model, self.ctx.settings.frame_bytes))
            for client in sent
        ])
        return unserved

    def _complete_round(self, job: SchedJob, record: dict[str, Any]) -> None:
        """The round's record is whole: keep it, tell watchers, then the next round or the end."""
        job.history.append(record)
        best = better(job.spec, record, job.best)
        if best is not None:
            job.best = best
        self.ctx.event(job.job_id, "round_completed", round=record["round"], data=record)
        self._gauge_round(job, record)
        self._go_on(job, record)

    def _go_on(self, job: SchedJob, record: dict[str, Any]) -> None:
        if record["round"] >= job.spec.rounds:
            self.ctx.finish(job, COMPLETED, "", model_path=record.get("model_path"), best=job.best)
        else:
            self.rounds.start_round(job, record["round"] + 1)

    def _recorded(self, job: SchedJob, server_round: int) -> bool:
        """A round recorded whose next one never started (a publish failed): start it now.

        The message that completed the round is handled again after a lost connection; the
        record stays as it was, and the job goes on from it. True when that was the case.
        """
        if not (job.history and job.history[-1]["round"] == server_round == job.round):
            return False
        log.info("round_recorded_going_on", round=server_round)
        self._go_on(job, job.history[-1])
        return True

    def _gauge_round(self, job: SchedJob, record: dict[str, Any]) -> None:
        m = self.ctx.metrics
        m.current_round.labels(job.job_id).set(record["round"])
        if "federated" in record["metrics"]:  # the aggregator exports the sources it computes
            m.round_metrics(job.job_id, {"federated": record["metrics"]["federated"]})
        if record["round"] > 0:
            m.rounds_completed.labels(job.job_id).inc()
            m.round_duration.observe(record.get("seconds", 0.0))
