"""Aggregator dispatch: each message on fedmq.aggregator decoded, checked against its sender and
routed to the object that holds its concern.

    fedmq.aggregator ─▶ on_message: decode, then by type
        JobCreate     create_job     ─▶ RoundClosed (round 0) ─▶ scheduler
        RoundOpen     open_round     ─▶ UpdateAccepted for updates that came before it
        ClientUpdate  accept_update  ─▶ UpdateAccepted(s) ─▶ scheduler (or kept until its RoundOpen)
        GroupUpdate   accept_group   ─▶ UpdatesAccepted: each member as if a ClientUpdate
                      (the round's last, when its RoundOpen lets it: close_complete ─▶ the round
                      closed here, UpdatesAccepted(closed) and RoundClosed ─▶ scheduler)
        RoundClose    close_round    ─▶ RoundClosed ─▶ scheduler
        DdpModel      store_ddp_model ─▶ DdpStored ─▶ scheduler
        each only from its senders' broker users (common/senders.py), else rejected "sender"
    fedmq.model ─▶ serving.ModelServer ─▶ ModelReply ─▶ the learner that asked

    admission.Admission   whether an update may be kept, and how (new, early, duplicate)
    intake.Intake         admitted updates into the job's store, and their announcements
    commit.GroupCommit    updates that came together, stored, announced and acked together;
                          the queue held behind a failed state write until its retry
    pruning.Pruner        old checkpoints out after each round; each job's disk quota
    ddpmodels.DdpModels   a DDP job's checkpoints and final model
    failures.JobFailures  a job ended by its user code, a limit or refused code; JobFailed

Ack policy: every message on fedmq.aggregator is acked after its effect is on
disk and its reply published; an update that came before its round's RoundOpen
is acked once on disk and announced when the round opens. Updates that arrive
together (prefetch PREFETCH) are a group commit: each is checked and written as it
comes, then, once no more have arrived (Bus.call_when_idle) or before any other
message is handled, all are made durable at once, announced in one message per
round (UpdatesAccepted) and acked; a round whose every update is stored then, and whose
RoundOpen lets it, is closed before they are announced, and its RoundClosed sent with them. An
update of the round closed last (no round open since) that comes again brings its RoundClosed again,
and so does a start, for each job with no round open: the scheduler may never have heard of a close
made here. A message that fails
decoding or validation is rejected (dead-lettered) with the reason; a duplicate
update is acked with no effect. User code that raises (building, loading data,
evaluating) fails the job: a JobFailed naming phase, type and message goes to
the scheduler and the message is acked. A state write that fails (disk full)
leaves the message unacked, to be handled again after a backoff (stateretry).
ModelGet requests are answered by serving.ModelServer.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import structlog

from fedmq.common import codec
from fedmq.common.allowlist import AllowList, CodeNotAllowed
from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.errors import FedmqError, ValidationError
from fedmq.common.inbox import KEPT, Handled, Inbox
from fedmq.common.jobspec import parse_job
from fedmq.common.messages import (
    PUSHED_MODEL_MAX,
    ClientUpdate,
    DdpModel,
    FailedClient,
    GroupUpdate,
    JobCreate,
    JobFailed,
    Message,
    RoundClose,
    RoundClosed,
    RoundOpen,
    from_wire,
    from_wire_file,
    to_wire,
)
from fedmq.common.metrics import Metrics, reason_label
from fedmq.common.settings import Settings
from fedmq.common.speclimits import SpecTooLarge
from fedmq.common.statefiles import remove_temps
from fedmq.common.stateretry import StateRetry
from fedmq.common.usercode import UserCodeError
from fedmq.services.aggregator.admission import Admission
from fedmq.services.aggregator.commit import PREFETCH, GroupCommit
from fedmq.services.aggregator.ddpmodels import DdpModels
from fedmq.services.aggregator.failures import JobFailures
from fedmq.services.aggregator.intake import Intake, accepted, accepted_again, stored
from fedmq.services.aggregator.jobs import AggJob, new_job, restore_job, rewind, stored_jobs
from fedmq.services.aggregator.limits import OverLimit, check_model, model_bytes
from fedmq.services.aggregator.pruning import Pruner
from fedmq.services.aggregator.rounds import close_round, initial_round
from fedmq.services.aggregator.serving import ModelServer
from fedmq.services.aggregator.store import TRASH

log = structlog.get_logger("fedmq.aggregator")


class AggregatorService:
    """The aggregator: routes each message to the object that holds its concern, then acks."""

    def __init__(
        self, settings: Settings, bus: Bus, metrics: Metrics | None = None, allowed: AllowList | None = None
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.metrics = metrics or Metrics()
        self.allowed = allowed or AllowList.services(settings.allowed_prefixes)
        self.root = Path(settings.state_dir) / "aggregator"
        self.jobs: dict[str, AggJob] = {}
        self.senders = settings.role_users
        self.models = ModelServer(bus, self.jobs, self.senders, settings.users_of_sites, ddp_root=self.root)
        self.retry = StateRetry(bus, self.metrics, settings)
        self.pruner = Pruner(settings)
        self.admission = Admission(settings, self.metrics)
        self.ddp = DdpModels(self.root, settings, self.jobs)
        self.failures = JobFailures(self.jobs, self.metrics, self._publish)
        self.intake = Intake(self.pruner, self.metrics)
        self.commits = GroupCommit(bus, self.metrics, self.retry, settings.retry_initial_s,
                                   process=self._process, measure=self.pruner.measure,
                                   close=self.close_complete, tidy=self.tidy)
        # A message whose state write failed keeps its place: the queue waits behind it (commit.py).
        self.inbox = Inbox(self.senders, settings.max_message_bytes, decode=self._decode,
                           refused=self._count_refused, service="aggregator", retry=self.retry,
                           unwritable=lambda exc, delivery: self.commits.stall(exc, [delivery]))

    def start(self) -> None:
        # Updates bigger than a frame are received straight into files: memory holds one chunk.
        # Files a previous run left half-received belong to messages the broker still holds.
        shutil.rmtree(self.root / "spool", ignore_errors=True)
        shutil.rmtree(self.root / TRASH, ignore_errors=True)  # what a stop left undeleted
        if removed := remove_temps(self.root):  # what a crash left mid-write: never read, only in the way
            log.info("temp_files_removed", count=removed)
        for job_id in stored_jobs(self.root):
            try:
                job = restore_job(self.root, job_id, self.allowed, self.settings.fsync)
            except UserCodeError as exc:
                self.bus.call_soon(functools.partial(self.failures.user_code, job_id, exc, 0))
                continue
            except CodeNotAllowed as exc:  # stored before the allow-list was narrowed
                self.failures.code_refused(exc)
                self.bus.call_soon(functools.partial(
                    self._publish, JobFailed(job_id=job_id, reason=f"aggregator: {exc}")))
                continue
            self.jobs[job.job_id] = job
            log.info("job_resumed", job=job.job_id, round=job.round, open_round=job.open_round)
            # Its last close again, unless a round opened since: one this aggregator made itself
            # (RoundOpen.close_when_complete) may never have reached the scheduler, whose RoundClose
            # would ask for it again, and on the in-memory bus the update that closed it is gone.
            # A scheduler past it ignores it.
            if job.open_round is None:
                self.bus.call_soon(functools.partial(self._resend_closed, job, job.round))
        # Read early: a large update is taken while its learner sends it (the aggregator consumes
        # its queue alone), so that its time on the bus is the learner's, not then the aggregator's.
        self.bus.consume(topology.AGGREGATOR, self.on_message, prefetch=PREFETCH, spool=self.root / "spool",
                         read_early=True)
        self.bus.consume(topology.MODEL, self.models.on_model_get, prefetch=4)

    # -- dispatch -------------------------------------------------------------

    def on_message(self, delivery: Delivery) -> None:
        if not self.commits.hold(delivery):  # a state write waiting for its retry holds the queue
            self._process(delivery)

    def _process(self, delivery: Delivery) -> None:
        self.inbox.handle(delivery, self._dispatch)

    def _dispatch(self, msg: Message, delivery: Delivery) -> Handled:
        if not isinstance(msg, ClientUpdate | GroupUpdate) and not self.commits.commit(then=delivery):
            return KEPT  # the updates before it are stored and announced first: they wait, and so does it
        try:
            with structlog.contextvars.bound_contextvars(
                job=msg.job_id, round=getattr(msg, "round", None), client=getattr(msg, "client", None)
            ):
                if self._handle(msg, delivery) == KEPT:
                    return KEPT
        except UserCodeError as exc:
            self.failures.user_code(msg.job_id, exc, getattr(msg, "round", 0))
        except OverLimit as exc:
            self.failures.over_limit(msg.job_id, exc)
        self.retry.succeeded()
        return None

    def _decode(self, delivery: Delivery) -> Message:
        """The message, read from its spool file when it was too large for memory."""
        limit = self.settings.max_message_bytes
        if delivery.body_path is not None:
            return from_wire_file(delivery.body_path, max_bytes=limit)
        return from_wire(delivery.body, max_bytes=limit)

    def _count_refused(self, msg: Message, reason: str) -> None:
        if isinstance(msg, ClientUpdate | GroupUpdate):  # a refused group: each of its members
            count = len(msg.members) if isinstance(msg, GroupUpdate) else 1
            self.metrics.updates_rejected.labels(reason_label(reason)).inc(count)

    def _handle(self, msg: Message, delivery: Delivery) -> Handled:
        """Handle a message; KEPT: its delivery is settled later (accept_update)."""
        if self.failures.ended(msg):
            return None
        match msg:
            case JobCreate():
                self.create_job(msg)
            case RoundOpen():
                self.open_round(msg)
            case ClientUpdate():
                return self.accept_update(msg, delivery)
            case GroupUpdate():
                return self.accept_group(msg, delivery)
            case RoundClose():
                self.close_round(msg)
            case DdpModel():
                self.store_ddp_model(msg)
            case _:
                raise ValidationError("unexpected_type", msg.type)  # type: ignore[attr-defined]
        return None

    def store_ddp_model(self, msg: DdpModel) -> None:
        """A DDP job's checkpoint or final model from its rank 0: kept and served like a round's."""
        self._publish(self.ddp.store(msg))

    # -- handlers -------------------------------------------------------------

    def create_job(self, msg: JobCreate) -> None:
        if msg.job_id in self.jobs:
            log.info("job_create_duplicate")
            self._resend_closed(self.jobs[msg.job_id], 0)
            return
        try:
            job = new_job(self.root, msg.job_id, parse_job(msg.spec), self.allowed, self.settings.fsync)
        except UserCodeError:
            raise
        except CodeNotAllowed as exc:  # the scheduler refuses these: this one came another way
            self.failures.code_refused(exc)
            self._publish(JobFailed(job_id=msg.job_id, reason=f"aggregator: {exc}"))
            return
        except FedmqError as exc:
            log.warning("job_create_failed", error=str(exc))
            if isinstance(exc, SpecTooLarge):  # the scheduler refuses these: this one came another way
                self.metrics.refused(exc.limit)
            self._publish(JobFailed(job_id=msg.job_id, reason=f"aggregator: {exc}"))
            return
        # Past a limit here, the job is not kept: a redelivered JobCreate is refused the same way.
        check_model(job.weights, self.settings.max_model_bytes)
        self.pruner.disk(job).need(model_bytes(job.weights), "the initial checkpoint")
        closed = initial_round(job, self.settings.data_dir)
        log.info("job_created", params=sum(v.numel() for v in job.weights.values()), digest=job.digest[:12])
        self.jobs[msg.job_id] = job
        self._report(closed)

    def open_round(self, msg: RoundOpen) -> None:
        """Open the round, take in the updates that came before it, and announce every stored one."""
        job = self._job(msg.job_id)
        if msg.round != job.round + 1:
            raise ValidationError("stale_round", f"round {msg.round} opened after round {job.round}")
        job.store.save_json("open", {"round": msg.round, "clients": sorted(msg.clients),
                                     "close": msg.close_when_complete, "keep": msg.keep})
        job.open_round, job.expected = msg.round, set(msg.clients)
        job.close_when_complete, job.keep = msg.close_when_complete, list(msg.keep)
        self.intake.adopt_early(job, msg.round)
        job.arrived = set(job.store.stored_clients(msg.round))
        # Announced here, not on arrival; again if this RoundOpen is redelivered (counted once).
        for reply in stored(job, msg.round):
            self._publish(reply)
        log.info("round_opened", clients=len(msg.clients), stored=len(job.store.stored_clients(msg.round)))

    def accept_update(self, msg: ClientUpdate, delivery: Delivery) -> Handled:
        """Store a sound update before saying so; a redelivered one is only announced again.

        Updates that come together are stored, announced and acked together (KEPT: see
        commit.GroupCommit). An update for the round after the last closed one, before its RoundOpen arrives
        (broker flow control can order them so), is checked and kept on disk; the RoundOpen
        announces it. So is a large one, received into a spool file, on its own.
        """
        job = self._job(msg.job_id)
        if self._folded(job, msg.round, [msg.client], delivery.user_id):
            return None
        kind = self.admission.admit(job, msg, delivery.user_id)
        size = _size(delivery)
        if kind != "early" and delivery.body_path is None:
            if kind == "new":
                self.pruner.disk(job).need(size, f"the update of client {msg.client}")
                job.store.stage_update(msg.round, msg.client, delivery.body)
                log.info("update_accepted", client=msg.client, examples=msg.num_examples, learner=msg.learner)
            else:
                log.info("update_duplicate", client=msg.client)
            # A duplicate says its size too: the scheduler counts a client's first announcement,
            # and the first may be this one (a group whose store failed part-way, then retried).
            reply = accepted(msg, size) if kind == "new" else accepted_again(job, msg, size)
            self.commits.defer(job, delivery, [reply], int(kind == "new"))
            return KEPT
        if not self.commits.commit(then=delivery):
            return KEPT  # it waits behind the updates before it
        self.intake.keep(job, msg, kind, delivery.body_path or delivery.body, size)
        if kind != "early":
            self._publish(accepted(msg, size) if kind == "new" else accepted_again(job, msg, size))
            job.arrived.add(msg.client)  # the round closes here when the group commit stores its last
        return None

    def accept_group(self, msg: GroupUpdate, delivery: Delivery) -> Handled:
        """A fused group's updates (common/groups.py): each member checked as if it had come alone,
        the scheduler told of them in UpdatesAccepted messages. All sound: the body is kept once, as
        one file, stored, announced and acked with the updates that came with it (KEPT, as
        accept_update's). A member refused: it is counted and logged, the others are kept as single
        updates (a kept group file has no refused rows). All refused: the message is dead-lettered."""
        job = self._job(msg.job_id)
        if self._folded(job, msg.round, [member.client for member in msg.members], delivery.user_id):
            return None
        updates, admitted = self.admission.admit_group(job, msg, delivery.user_id)
        whole = len(admitted) == len(updates) and all(kind != "early" for _, kind in admitted)
        if whole and delivery.body_path is None:
            size = _size(delivery)
            replies, new = self.intake.stage_group(job, msg, admitted, delivery.body, size)
            self.commits.defer(job, delivery, replies, new)
            return KEPT
        if not self.commits.commit(then=delivery):
            return KEPT  # it waits behind the updates before it
        body = delivery.body_path or delivery.body
        for reply in self.intake.keep_group(job, msg, updates, admitted, body, _size(delivery)):
            self._publish(reply)
            if reply.round == job.open_round:
                job.arrived.update(update.client for update in reply.updates)
        return None

    def close_round(self, msg: RoundClose) -> None:
        job = self._job(msg.job_id)
        if msg.round <= job.round and job.open_round is None:
            log.info("round_close_duplicate")  # redelivered after it took effect
            self._resend_closed(job, msg.round)
            return
        if job.open_round != msg.round:
            raise ValidationError("stale_round", f"round {msg.round} is not open")
        self._publish(self._close(job, msg.round, msg.clients, msg.failed))
        self.tidy(job, msg.keep)

    def _close(
        self, job: AggJob, server_round: int, clients: list[int], failed: list[FailedClient]
    ) -> RoundClosed:
        """Fold the round's updates into a committed new model; the RoundClosed that says so (`tidy`
        then, once it is sent: the scheduler waits for it, not for the files going)."""
        self.pruner.disk(job).need(model_bytes(job.weights), f"round {server_round}'s checkpoint")
        try:
            closed = close_round(job, server_round, clients, failed, self.settings.data_dir)
        except BaseException:
            rewind(job)  # the model and strategy back to the last committed round
            job.unpruned = True  # its checkpoint may be on disk, never committed
            raise
        self.models.forget(job.job_id)
        return self._closed(closed)

    def tidy(self, job: AggJob, keep: list[str] | None = None) -> None:
        """After a round's close is sent: the updates of every round closed go (an earlier tidy
        that never ran, its publish failed, leaves none behind), and old checkpoints but the
        current one and `keep` (RoundClose.keep; by default the RoundOpen's)."""
        job.store.drop_updates_through(job.round)
        self.pruner.prune(job, job.keep if keep is None else keep)

    def close_complete(self, job: AggJob) -> RoundClosed | None:
        """Close the job's open round now that every client's update is stored (RoundOpen's
        close_when_complete), as the scheduler's RoundClose would: its RoundClosed, to be announced
        after those updates (commit.GroupCommit). None: not closed here. Its user code failed or it
        passed a limit (the job is over, JobFailed sent), or the close failed otherwise (a disk
        full, logged): the scheduler, told of the updates, sends the RoundClose that tries again."""
        server_round = job.open_round
        assert server_round is not None
        with structlog.contextvars.bound_contextvars(job=job.job_id, round=server_round):
            try:
                return self._close(job, server_round, sorted(job.expected), [])
            except UserCodeError as exc:
                self.failures.user_code(job.job_id, exc, server_round)
            except OverLimit as exc:
                self.failures.over_limit(job.job_id, exc)
            except Exception as exc:
                log.warning("round_close_deferred", error=repr(exc)[:300])
        return None

    def _folded(self, job: AggJob, server_round: int, clients: list[int], user_id: str | None) -> bool:
        """Whether these clients' update for `server_round` was folded into the round closed last,
        with no round open since: a redelivered update that may have closed the round itself
        (RoundOpen's close_when_complete) before the announcement saying so went out (a crash, a
        failed publish). Its RoundClosed goes again; the update changes nothing. A sender who may
        not send one of them is refused, as admission would."""
        closed = job.last_closed
        if (job.open_round is not None or closed is None or closed.round != server_round
                or not set(clients) <= set(closed.clients)):
            return False
        for client in clients:
            self.admission.check_sender(job, client, user_id)
        log.info("update_folded_already", clients=len(clients))
        self._resend_closed(job, server_round)
        return True

    # -- replies --------------------------------------------------------------

    def _closed(self, closed: RoundClosed) -> RoundClosed:
        """A closed round (its record on disk already) as the scheduler hears of it: counted,
        logged, with the model when it is pushed."""
        self.metrics.round_metrics(closed.job_id, closed.metrics)
        shown = {f"{src}_{name}": round(v, 4) for src, m in closed.metrics.items() for name, v in m.items()}
        log.info("round_closed", clients=len(closed.clients), seconds=round(closed.aggregate_seconds, 4),
                 **shown)
        return self._with_model(closed)

    def _report(self, closed: RoundClosed) -> None:
        """Tell the scheduler the round is closed (its record is on disk already)."""
        self._publish(self._closed(closed))

    def _resend_closed(self, job: AggJob, server_round: int) -> None:
        if job.last_closed is not None and job.last_closed.round == server_round:
            self._publish(self._with_model(job.last_closed))

    def _with_model(self, closed: RoundClosed) -> RoundClosed:
        """`closed` carrying the job's model (the one it announces) when that is small enough to go
        to the learners with the next round's tasks (FEDMQ_PUSH_MODEL_BYTES, and half a frame: the
        scheduler's and the learners' inboxes read no more), and is sent as it is."""
        job = self.jobs.get(closed.job_id)
        limit = min(self.settings.push_model_bytes, self.settings.frame_bytes // 2, PUSHED_MODEL_MAX)
        if (job is None or job.digest != closed.model_digest or job.spec.compression.downlink != "none"
                or model_bytes(job.weights) > limit):
            return closed
        packed = codec.packb(dict(job.weights))
        return closed.model_copy(update={"model": packed}) if len(packed) <= limit else closed

    def _publish(self, msg: Message) -> None:
        self.bus.publish(topology.SCHEDULER, to_wire(msg))

    def _job(self, job_id: str) -> AggJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise ValidationError("unknown_job", job_id)
        return job


def _size(delivery: Delivery) -> int:
    """A received message's size: its spool file's, or its body's."""
    return delivery.body_path.stat().st_size if delivery.body_path is not None else len(delivery.body)
