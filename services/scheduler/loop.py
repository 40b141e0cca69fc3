"""Each job's round loop: open a round, dispatch its tasks, watch its deadlines, close, retry or fail.

    RoundClosed(r-1) ─▶ start_round(r): RoundOpen ─▶ aggregator, TrainTasks × learners ─▶ learners
    UpdateAccepted / ClientFailure / a deadline ─▶ advance: CLOSE (RoundClose) | RETRY | FAIL
    near a round's deadline: tasks still missing go out again (nudge)
    no round 1 by FEDMQ_JOB_START_TIMEOUT_S after acceptance: the job fails

SchedulerService holds one RoundLoop, built on the shared SchedContext. The deadlines it arms
run whatever is active when they fire: the training round, or the federated evaluation of the
round just closed, which it reaches through the two callbacks it is given (evaluation.py's
EvaluationLoop.dispatch and .advance); the evaluation loop calls back start_round and the
dispatch helpers here.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import structlog

from fedmq.common.bus import topology
from fedmq.common.messages import (
    EvalTask,
    FailedClient,
    RoundClose,
    RoundOpen,
    TrainTask,
    TrainTasks,
    batch_of,
    to_wire,
)
from fedmq.services.scheduler.context import SchedContext, cancel_timers
from fedmq.services.scheduler.jobs import (
    FAILED,
    RUNNING,
    SchedJob,
    tracks_holders,
)
from fedmq.services.scheduler.rounds import Decision, RoundState
from fedmq.services.scheduler.sampling import sample_clients

log = structlog.get_logger("fedmq.scheduler")

# The most messages of one dispatch that carry the round's model (a small one the aggregator sent):
# beyond, none does and the learners fetch it, rather than the broker storing it that many times.
PUSH_MESSAGES_MAX = 64
NUDGE_BEFORE = 0.2  # re-dispatch missing tasks when this share of the round's time is left
# The most tasks of a round sent to one learner's own queue: well inside its prefetch there
# (learner/service.py CONTROL_PREFETCH), so its DDP control messages never wait behind them.
HOLDER_SHARE_MAX = 32

# The evaluation loop's: send a round's EvalTasks (returns the clients not sent), and move it on.
DispatchEval = Callable[[SchedJob, int, list[int]], list[int]]
AdvanceEval = Callable[[SchedJob], None]


class RoundLoop:
    """Rounds, their tasks and deadlines, and the start deadline of every job."""

    def __init__(self, ctx: SchedContext, dispatch_eval: DispatchEval, advance_eval: AdvanceEval) -> None:
        self.ctx = ctx
        self.dispatch_eval = dispatch_eval
        self.advance_eval = advance_eval

    def start_round(self, job: SchedJob, server_round: int) -> None:
        """Open a round. Everything is published before the job's state moves on, so a
        publish that fails leaves the RoundClosed that started it to be redelivered and
        handled again (the aggregator and learners take the repeats as duplicates)."""
        spec = job.spec
        clients = sample_clients(spec.seed, server_round, spec.clients.total, spec.clients.sampled)
        closes = self.ctx.settings.aggregator_closes_rounds  # else an older aggregator reads it
        opening = RoundOpen(job_id=job.job_id, round=server_round, clients=clients,
                            close_when_complete=closes, keep=kept_checkpoints(job) if closes else [])
        unserved = self._dispatch(job, server_round, clients, first=(topology.AGGREGATOR, to_wire(opening)),
                                  to_holders=True)
        job.round, job.sync = server_round, {}
        job.state = RoundState(
            round=server_round,
            clients=clients,
            quorum=spec.clients.quorum,
            deadline=time.monotonic() + spec.round_timeout_s,
            retries_left=spec.max_round_retries,
            started=time.monotonic(),
        )
        self.drop_unserved(job, job.state, unserved)
        self.arm_deadline(job)
        self.ctx.event(job.job_id, "round_started", round=server_round, data={"clients": len(clients)})

    def unserved(self, job: SchedJob, clients: list[int]) -> list[int]:
        """The clients that are sites no alive learner hosts: their tasks are not sent this time."""
        if job.spec.clients.sites is None or self.ctx.hearing_learners():
            return []
        hosted = self.ctx.registry.hosted_sites()
        return [c for c in clients if job.spec.clients.site(c) not in hosted]

    def drop_unserved(self, job: SchedJob, state: RoundState, unserved: list[int]) -> None:
        """Sites without a live learner are dropped clients of this attempt, visibly, under the quorum."""
        for client in unserved:
            site = job.spec.clients.site(client)
            state.record_failure(client, f"no_site_learner: no live learner hosts site {site}", "placement")
            self.ctx.metrics.client_failures.labels("no_site_learner").inc()
        if unserved:
            log.warning("sites_unserved", round=state.round,
                        sites=[job.spec.clients.site(c) for c in unserved])

    def task_queue(self, job: SchedJob, client: int, holder: str = "") -> str:
        """Where a client's task goes: its site's queue; the queue of the live learner that keeps its
        state (`holder`), unless it runs a DDP rank; else the shared queue of logical clients."""
        site = job.spec.clients.site(client)
        if site is not None:
            return topology.site_queue(site)
        if holder and self.ctx.registry.is_free(holder) and not self._in_group(holder):
            return topology.learner_queue(holder)
        return topology.TASKS

    def _in_group(self, learner: str) -> bool:
        """Whether a running DDP job counts `learner` among its group's members (launched, perhaps
        before the learner's heartbeat says so)."""
        return any(job.status == RUNNING and job.group and learner in job.group["members"]
                   for job in self.ctx.jobs.values())

    def redispatch_held(self, learner: str) -> None:
        """`learner` died or left: the tasks of running rounds sent to its own queue go to the shared one."""
        for job in self.ctx.jobs.values():
            state = job.state
            if job.status != RUNNING or job.holders is None or state is None or state.closing:
                continue
            if job.evaluation is not None or state.round != job.round:
                continue
            held = [c for c in state.missing
                    if c not in state.failed and c in job.holders and job.holders[c][1] == learner]
            if held:
                log.info("tasks_redispatched", learner=learner, round=state.round, clients=len(held))
                self._dispatch(job, state.round, held)
                self.ctx.metrics.tasks_redispatched.inc(len(held))

    def _dispatch(
        self, job: SchedJob, server_round: int, clients: list[int], first: tuple[str, bytes] | None = None,
        to_holders: bool = False,
    ) -> list[int]:
        """Send the clients' training tasks, after `first` and together with it (one wait for the
        broker, not one each); returns the sites' clients not sent (no learner hosts them).
        `to_holders` (a round's first dispatch): a client goes to the learner keeping its state; a
        task sent again (a nudge, a retry) goes to the shared queue, where any learner takes it."""
        unserved = self.unserved(job, clients)
        messages = [] if first is None else [first]
        kept = job.holders if tracks_holders(job) else None
        # A learner takes back at most its share of the clients whose state it keeps: the rest go to
        # the shared queue (their state fetched), so a round is not held by the busiest learner.
        share = min(HOLDER_SHARE_MAX, -(-len(clients) // max(1, self.ctx.registry.alive_count)))
        taken: dict[str, int] = {}
        queued: dict[str, list[TrainTask]] = {}  # each queue's tasks, in the clients' order
        serving: dict[str, int] = {}  # how many learners take from that queue
        for client in clients:
            if client in unserved:
                continue
            state_from, holder, tag = kept.get(client, (0, "", "")) if kept is not None else (None, "", "")
            taken[holder] = taken.get(holder, 0) + 1
            prefer = holder if to_holders and taken[holder] <= share else ""
            task = TrainTask(
                job_id=job.job_id,
                task_id=f"{job.job_id}:{server_round}:{client}",
                round=server_round,
                client=client,
                model_digest=job.model_digest,
                spec=job.raw_spec,
                config=job.config,
                state_from=state_from,
                state_holder=holder,
                state_tag=tag,
            )
            queue = self.task_queue(job, client, prefer)
            queued.setdefault(queue, []).append(task)
            if queue not in serving:
                serving[queue] = self._serving(job, client, queue)
        # One message per learner serving a queue (FEDMQ_TASK_BATCH the most in one): a learner takes
        # its share at once. Unknown learners (a scheduler just started): one a task, for any to take.
        batches: list[tuple[str, TrainTask | TrainTasks]] = []
        for queue, tasks in queued.items():
            learners = serving[queue]
            size = min(self.ctx.settings.task_batch, -(-len(tasks) // learners)) if learners else 1
            batches.extend((queue, batch_of(tasks[at:at + size])) for at in range(0, len(tasks), size))
        model = job.model if len(batches) <= PUSH_MESSAGES_MAX else b""
        frame = self.ctx.settings.frame_bytes
        messages.extend((queue, with_model(msg, model, frame)) for queue, msg in batches)
        self.ctx.bus.publish_all(messages)
        return unserved

    def _serving(self, job: SchedJob, client: int, queue: str) -> int:
        """How many learners take the tasks sent to `queue` (the client's): one for a learner's own."""
        site = job.spec.clients.site(client)
        if queue == topology.TASKS:
            return self.ctx.registry.serving(None)
        if site is not None and queue == topology.site_queue(site):
            return self.ctx.registry.serving(site)
        return 1

    def arm_deadline(self, job: SchedJob) -> None:
        """Timers for what runs now: the training round, or the evaluation of the round just closed."""
        cancel_timers(job)
        active = job.active
        assert active is not None
        delay = max(0.0, active.deadline - time.monotonic())
        server_round = active.round
        job.timer = self.ctx.bus.call_later(delay, lambda: self._on_deadline(job.job_id, server_round))
        # Near the deadline, tasks still missing go out again with the same ids: a learner that
        # froze (no broker redelivery yet) should not cost the round its quorum. Duplicates are ignored.
        nudge_in = delay - NUDGE_BEFORE * job.spec.round_timeout_s
        if nudge_in > 0:
            job.nudge = self.ctx.bus.call_later(nudge_in, lambda: self._on_nudge(job.job_id, server_round))

    def _on_nudge(self, job_id: str, server_round: int) -> None:
        job = self.ctx.jobs.get(job_id)
        active = job.active if job is not None and job.status == RUNNING else None
        if job is None or active is None or active.round != server_round:
            return
        missing = [c for c in active.missing if c not in active.failed]
        if active.closing or not missing:
            return
        log.info("round_redispatch", round=server_round, missing=len(missing))
        if job.evaluation is not None:
            unserved = self.dispatch_eval(job, server_round, missing)
        else:
            unserved = self._dispatch(job, server_round, missing)
        self.ctx.metrics.tasks_redispatched.inc(len(missing) - len(unserved))
        self.drop_unserved(job, active, unserved)

    def _on_deadline(self, job_id: str, server_round: int) -> None:
        job = self.ctx.jobs.get(job_id)
        active = job.active if job is not None and job.status == RUNNING else None
        if job is None or active is None or active.round != server_round:
            return
        try:
            if job.evaluation is not None:
                self.advance_eval(job)
            else:
                self.advance(job)
        except Exception:
            # A timer has no message to be redelivered: look again shortly.
            again = functools.partial(self._on_deadline, job_id, server_round)
            job.timer = self.ctx.bus.call_later(1.0, again)
            raise
        self.ctx.save(job)

    def advance(self, job: SchedJob) -> None:
        state = job.state
        assert state is not None
        decision = state.decide(time.monotonic())
        if decision is Decision.CLOSE:
            clients = sorted(state.reported)
            if len(clients) < len(state.clients):
                self.ctx.metrics.rounds_closed_at_deadline.inc()
            log.info("round_closing", reported=len(clients), sampled=len(state.clients),
                     failed=len(state.failed))
            self.ctx.bus.publish(  # first: if it fails, the message that got us here comes again
                topology.AGGREGATOR, to_wire(round_close(job.job_id, state, kept_checkpoints(job))),
            )
            state.closing = True
            cancel_timers(job)
        elif decision is Decision.RETRY:
            missing = state.retryable  # not the clients whose failure another attempt repeats
            log.warning("round_retry", missing=len(missing), retries_left=state.retries_left - 1)
            self.ctx.metrics.round_retries.inc()
            unserved = self._dispatch(job, state.round, missing)  # a failure: the message comes again
            state.retry(time.monotonic() + job.spec.round_timeout_s)
            self.drop_unserved(job, state, unserved)
            self.arm_deadline(job)
        elif decision is Decision.FAIL:
            reasons = sorted(set(state.failed.values()))[:3]
            nobody = "" if self.ctx.registry.alive_count else (
                "no learner is alive: start one with `fedmq learner` on this broker and vhost "
                "(`fedmq learners` lists them); ")
            self.ctx.finish(job, FAILED, (
                f"round {state.round}: {nobody}{len(state.reported)} of {len(state.clients)} clients "
                f"reported, quorum is {state.quorum}; failures: {reasons or 'timeouts'}"
            ))

    def closed_by_aggregator(self, job: SchedJob) -> None:
        """The aggregator closed the round itself, every client's update stored (RoundOpen's
        close_when_complete): the close `advance` would ask for. Its RoundClosed comes next; no
        RoundClose is sent (a restart before it comes sends one: the aggregator answers it again)."""
        state = job.state
        assert state is not None
        log.info("round_closing", reported=len(state.reported), sampled=len(state.clients),
                 failed=len(state.failed), by="aggregator")
        state.closing = True
        cancel_timers(job)

    def arm_start(self, job: SchedJob) -> None:
        """No job waits for its first round longer than the start deadline, whatever holds it up."""
        limit = self.ctx.settings.job_start_timeout_s
        delay = max(0.0, job.accepted_at + limit - time.time()) if job.accepted_at else limit
        self.ctx.bus.call_later(delay, functools.partial(self._on_start_deadline, job.job_id))

    def _on_start_deadline(self, job_id: str) -> None:
        job = self.ctx.jobs.get(job_id)
        if job is None or job.status != RUNNING or job.round > 0:
            return
        limit = self.ctx.settings.job_start_timeout_s
        if job.spec.ddp is not None:
            nodes = f" on nodes {job.spec.ddp.nodes}" if job.spec.ddp.nodes else ""
            why = f"fewer than {job.spec.ddp.world_size} idle learners{nodes} (`fedmq learners`)"
        else:
            why = ("the aggregator never reported its initial model (is `fedmq aggregator` running on this "
                   "broker and vhost? its log says why)")
        self.ctx.finish(job, FAILED, (
            f"job did not start within {limit:g} s: {why}; FEDMQ_JOB_START_TIMEOUT_S sets this limit"
        ))
        self.ctx.save(job)


def with_model(msg: TrainTask | TrainTasks | EvalTask, model: bytes, frame_bytes: int) -> bytes:
    """`msg` encoded with the round's model (b"": without), or without it where it would not fit the
    learners' frame (they then fetch it)."""
    if model:
        body = to_wire(msg.model_copy(update={"model": model}))
        if len(body) <= frame_bytes:
            return body
    return to_wire(msg)


def round_close(job_id: str, state: RoundState, keep: list[str] | None = None) -> RoundClose:
    """The RoundClose of a round: the clients that reported, why the others did not, and the
    checkpoints the aggregator must keep however few it retains (`keep`: see kept_checkpoints)."""
    failed = [FailedClient(client=c, reason=r[:2000], phase=p[:64]) for c, r, p in state.unreported()]
    return RoundClose(job_id=job_id, round=state.round, clients=sorted(state.reported), failed=failed,
                      keep=keep or [])


def kept_checkpoints(job: SchedJob) -> list[str]:
    """The checkpoints only the scheduler knows to be needed: the best round's so far."""
    return [str(job.best["model_digest"])] if job.best and job.best.get("model_digest") else []
