"""Aggregator handlers: create jobs, open rounds, accept updates, close rounds.

    fedmq.aggregator ─▶ on_message: decode, then by type
        JobCreate     create_job     ─▶ RoundClosed (round 0) ─▶ scheduler
        RoundOpen     open_round     ─▶ UpdateAccepted for updates that came before it
        ClientUpdate  accept_update  ─▶ UpdateAccepted(s) ─▶ scheduler (or kept until its RoundOpen)
        GroupUpdate   accept_group   ─▶ UpdatesAccepted: each member as if a ClientUpdate
        RoundClose    close_round    ─▶ RoundClosed ─▶ scheduler
        each only from its senders' broker users (common/senders.py), else rejected "sender"
    fedmq.model ─▶ serving.ModelServer ─▶ ModelReply ─▶ the learner that asked

Ack policy: every message on fedmq.aggregator is acked after its effect is on
disk and its reply published; an update that came before its round's RoundOpen
is acked once on disk and announced when the round opens. Updates that arrive
together (prefetch PREFETCH) are a group commit: each is checked and written as it
comes, then, once no more have arrived (Bus.call_when_idle) or before any other
message is handled, all are made durable at once, announced in one message per
round (UpdatesAccepted) and acked. A message that fails
decoding or validation is rejected (dead-lettered) with the reason; a duplicate
update is acked with no effect. User code that raises (building, loading data,
evaluating) fails the job: a JobFailed naming phase, type and message goes to
the scheduler and the message is acked. A state write that fails (disk full)
leaves the message unacked, to be handled again after a backoff (stateretry).
ModelGet requests are answered by serving.ModelServer.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections import deque
from pathlib import Path
from typing import Literal

import structlog
import torch

from fedmq.common.allowlist import AllowList, CodeNotAllowed
from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.checkpoint import save_model
from fedmq.common.errors import DecodeError, FedmqError, StateUnwritable, ValidationError
from fedmq.common.groups import finite_rows, members
from fedmq.common.jobspec import parse_job
from fedmq.common.messages import (
    ClientUpdate,
    DdpModel,
    DdpStored,
    GroupUpdate,
    JobCreate,
    JobFailed,
    Message,
    RoundClose,
    RoundClosed,
    RoundOpen,
    UpdateAccepted,
    UpdatesAccepted,
    from_wire,
    from_wire_file,
    to_wire,
)
from fedmq.common.metrics import Metrics, reason_label
from fedmq.common.senders import check_sender, check_site_sender
from fedmq.common.settings import Settings
from fedmq.common.speclimits import SpecTooLarge
from fedmq.common.statefiles import JOB_ID, remove_temps
from fedmq.common.stateretry import StateRetry
from fedmq.common.usercode import UserCodeError
from fedmq.services.aggregator.jobs import AggJob, new_job, restore_job, rewind, stored_jobs
from fedmq.services.aggregator.limits import DiskQuota, OverLimit, check_model, model_bytes, retained
from fedmq.services.aggregator.rounds import close_round, initial_round, keeps_learner_state
from fedmq.services.aggregator.serving import ModelServer
from fedmq.services.aggregator.store import TRASH, JobStore, weights_digest
from fedmq.services.aggregator.validation import check_job_update

log = structlog.get_logger("fedmq.aggregator")

DDP_CHECKPOINTS = "ddp_checkpoints"  # a DDP job's stored checkpoints: {step or "final": key}
Admitted = Literal["new", "early", "duplicate"]  # how an update that passed its checks is kept
ACCEPTED_PER_MESSAGE = 1000  # about 300 bytes each: far under the scheduler's frame
PREFETCH = 8  # updates that may come together, to be stored and announced together (group commit)
MEASURE_EVERY = 16  # rounds between walks of a job's folder for its disk quota (limits.DiskQuota)


class AggregatorService:
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
        # Updates staged and not yet settled: their job, delivery, announcement, and whether new.
        self._pending: list[tuple[AggJob, Delivery, UpdateAccepted, bool]] = []
        self._stalled = False  # a failed state write waits for its retry
        self._backlog: deque[Delivery] = deque()  # what waits behind it, in order

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
                self.bus.call_soon(functools.partial(self._user_code_failed, job_id, exc, 0))
                continue
            except CodeNotAllowed as exc:  # stored before the allow-list was narrowed
                self._code_refused(exc)
                self.bus.call_soon(functools.partial(
                    self._publish, JobFailed(job_id=job_id, reason=f"aggregator: {exc}")))
                continue
            self.jobs[job.job_id] = job
            log.info("job_resumed", job=job.job_id, round=job.round, open_round=job.open_round)
        self.bus.consume(topology.AGGREGATOR, self.on_message, prefetch=PREFETCH, spool=self.root / "spool")
        self.bus.consume(topology.MODEL, self.models.on_model_get, prefetch=4)

    # -- dispatch -------------------------------------------------------------

    def on_message(self, delivery: Delivery) -> None:
        if self._stalled:  # a state write waits for its retry: the queue waits behind it, in order
            self._backlog.append(delivery)
            return
        self._process(delivery)

    def _process(self, delivery: Delivery) -> None:
        try:
            msg = self._decode(delivery)
        except DecodeError as exc:
            self._reject(delivery, "decode", str(exc))
            return
        if not isinstance(msg, ClientUpdate) and not self._commit(then=delivery):
            return  # the updates before it are stored and announced first: they wait, and so does it
        try:
            with structlog.contextvars.bound_contextvars(
                job=msg.job_id, round=getattr(msg, "round", None), client=getattr(msg, "client", None)
            ):
                check_sender(msg.type, delivery.user_id, self.senders)  # type: ignore[attr-defined]
                if self._handle(msg, delivery) == "deferred":
                    return
        except StateUnwritable as exc:
            # Not the message's fault: keep it unacked (the queue waits) and handle it again later.
            self._stall(exc, [delivery])
            return
        except UserCodeError as exc:
            self._user_code_failed(msg.job_id, exc, getattr(msg, "round", 0))
        except OverLimit as exc:
            self._over_limit(msg.job_id, exc)
        except (DecodeError, ValidationError) as exc:
            reason = exc.reason if isinstance(exc, ValidationError) else "decode"
            if isinstance(msg, ClientUpdate | GroupUpdate):  # a refused group: each of its members
                count = len(msg.members) if isinstance(msg, GroupUpdate) else 1
                self.metrics.updates_rejected.labels(reason_label(reason)).inc(count)
            self._reject(delivery, reason, getattr(exc, "detail", str(exc)))
            return
        self.retry.succeeded()
        delivery.ack()

    def _stall(self, exc: Exception, deliveries: list[Delivery]) -> None:
        """A state write (or a group's announcement) failed: `deliveries`, then every later one,
        wait unacked for the retry after a backoff."""
        if not self._stalled:
            if isinstance(exc, StateUnwritable):
                self.retry.later(exc, self._resume)
            else:
                self.bus.call_later(self.settings.retry_initial_s, self._resume)
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
                self._process(delivery)
            except Exception as exc:  # as the bus does for a handler: dead-lettered, the rest go on
                if not delivery.live():
                    raise  # the connection is gone: the bus connects again, the broker gives them back
                log.exception("handler_crashed", queue=delivery.queue)
                delivery.reject(f"handler_error: {type(exc).__name__}")

    # -- the group commit -------------------------------------------------------

    def _defer(self, job: AggJob, delivery: Delivery, reply: UpdateAccepted, new: bool) -> None:
        """Settle an update with those that came with it: stored together, announced in one
        message per round, acked together, once the deliveries that have arrived are handled."""
        if not self._pending:
            self.bus.call_when_idle(self._commit_now)
        self._pending.append((job, delivery, reply, new))

    def _commit_now(self) -> None:
        self._commit()

    def _commit(self, then: Delivery | None = None) -> bool:
        """Store, announce and ack the deferred updates. False if storing failed: then they, and
        `then` after them, wait unacked to be handled again after a backoff (their files deleted,
        the job's disk measured again)."""
        if not self._pending:
            return True
        pending, self._pending = self._pending, []
        jobs = list({id(job): job for job, _, _, _ in pending}.values())
        deliveries = [delivery for _, delivery, _, _ in pending]
        waiting = deliveries + ([then] if then else [])  # what waits for a retry if this fails
        try:
            for job in jobs:
                job.store.commit_staged()
        except StateUnwritable as exc:
            for job in jobs:
                self._disk(job).measure()
            self._stall(exc, waiting)
            return False
        self.metrics.updates_accepted.inc(sum(new for _, _, _, new in pending))
        by_round: dict[tuple[str, int], list[UpdateAccepted]] = {}
        for _, _, reply, _ in pending:
            by_round.setdefault((reply.job_id, reply.round), []).append(reply)
        try:
            self.bus.publish_all([
                (topology.SCHEDULER, to_wire(replies[0] if len(replies) == 1 else
                                             UpdatesAccepted(job_id=job_id, round=rnd, updates=replies)))
                for (job_id, rnd), replies in by_round.items()
            ])
        except Exception as exc:
            # Stored, not announced: after a backoff each is handled again, in order, as a
            # duplicate, and announced then. A lost connection: the broker gives them back.
            live = [delivery for delivery in waiting if delivery.live()]
            if not live:
                raise
            log.warning("updates_not_announced", count=len(pending), error=repr(exc)[:300])
            self._stall(exc, live)
            return False
        self.retry.succeeded()
        for delivery in deliveries:
            delivery.ack()
        return True

    def _decode(self, delivery: Delivery) -> Message:
        """The message, read from its spool file when it was too large for memory."""
        limit = self.settings.max_message_bytes
        if delivery.body_path is not None:
            return from_wire_file(delivery.body_path, max_bytes=limit)
        return from_wire(delivery.body, max_bytes=limit)

    def _reject(self, delivery: Delivery, reason: str, detail: str) -> None:
        log.warning("message_rejected", reason=reason, detail=detail[:500])
        delivery.reject(f"{reason}: {detail}")

    def _handle(self, msg: Message, delivery: Delivery) -> Literal["deferred"] | None:
        """Handle a message; "deferred": its delivery is settled later (accept_update)."""
        job = self.jobs.get(msg.job_id)
        if job is not None and (job.failed is not None or job.stopped is not None):
            log.info("ignored_failed_job", type=msg.type)  # type: ignore[attr-defined]
            if isinstance(msg, JobCreate | RoundClose):
                reason = job.failed.line() if job.failed is not None else str(job.stopped)
                self._publish(JobFailed(job_id=job.job_id, reason=reason, error=job.failed))
            return None
        match msg:
            case JobCreate():
                self.create_job(msg)
            case RoundOpen():
                self.open_round(msg)
            case ClientUpdate():
                return self.accept_update(msg, delivery)
            case GroupUpdate():
                self.accept_group(msg, delivery)
            case RoundClose():
                self.close_round(msg)
            case DdpModel():
                self.store_ddp_model(msg)
            case _:
                raise ValidationError("unexpected_type", msg.type)  # type: ignore[attr-defined]
        return None

    def store_ddp_model(self, msg: DdpModel) -> None:
        """A DDP job's checkpoint or final model from its rank 0: kept and served like a round's.

        Idempotent (a checkpoint is named by its digest), so a redelivery only says it again."""
        spec = parse_job(msg.spec)
        if spec.ddp is None:
            raise ValidationError("invalid_spec", "a DDP model for a job that is not a DDP job")
        federated = msg.job_id in self.jobs or JobStore(self.root, msg.job_id).rounds()
        if not JOB_ID.fullmatch(msg.job_id) or federated:
            raise ValidationError("unknown_job", f"{msg.job_id[:80]!r} is no DDP job's id")
        weights = {name: value for name, value in msg.weights.items() if isinstance(value, torch.Tensor)}
        if len(weights) != len(msg.weights) or not weights:
            raise ValidationError("wrong_tensors", "a DDP model holds tensors only")
        check_model(weights, self.settings.max_model_bytes)
        store = JobStore(self.root, msg.job_id, self.settings.fsync)
        if store.load_spec() is None:
            store.save_spec(json.dumps(msg.spec, sort_keys=True))
        key = store.write_checkpoint(msg.step, weights, {})
        digest = weights_digest(key)
        model_path = ""
        if msg.kind == "final":
            path = store.root / "model.safetensors"
            save_model(path, weights, json.dumps(msg.spec, sort_keys=True), job_id=msg.job_id, round=1)
            model_path = str(path)
        self._prune_ddp(store, msg, key)
        log.info("ddp_model_stored", kind=msg.kind, step=msg.step, digest=digest[:12])
        self._publish(DdpStored(job_id=msg.job_id, attempt=msg.attempt, kind=msg.kind, step=msg.step,
                                digest=digest, model_path=model_path))

    def _prune_ddp(self, store: JobStore, msg: DdpModel, key: str) -> None:
        """With FEDMQ_KEEP_CHECKPOINTS=N, a DDP job keeps its newest max(N, 2) checkpoints by step
        (a restart resumes from the newest the scheduler has heard of) and its final model."""
        kept = store.load_json(DDP_CHECKPOINTS) or {}
        kept[msg.kind if msg.kind == "final" else str(msg.step)] = key
        steps = sorted((s for s in kept if s != "final"), key=int)
        keep = self.settings.keep_checkpoints
        if keep:
            final = {"final": kept["final"]} if "final" in kept else {}
            kept = {s: kept[s] for s in steps[-max(keep, 2):]} | final
        store.save_json(DDP_CHECKPOINTS, kept)
        if keep and (gone := store.prune_checkpoints(set(kept.values()))):
            log.info("checkpoints_pruned", count=len(gone), kept=len(kept))

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
            self._code_refused(exc)
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
        self._disk(job).need(model_bytes(job.weights), "the initial checkpoint")
        closed = initial_round(job, self.settings.data_dir)
        log.info("job_created", params=sum(v.numel() for v in job.weights.values()), digest=job.digest[:12])
        self.jobs[msg.job_id] = job
        self._report(closed)

    def _code_refused(self, exc: CodeNotAllowed) -> None:
        log.warning("job_code_refused", what=exc.what, module=exc.module)
        self.metrics.refused_code(exc.what)

    def open_round(self, msg: RoundOpen) -> None:
        """Open the round, take in the updates that came before it, and announce every stored one."""
        job = self._job(msg.job_id)
        if msg.round != job.round + 1:
            raise ValidationError("stale_round", f"round {msg.round} opened after round {job.round}")
        job.store.save_json("open", {"round": msg.round, "clients": sorted(msg.clients)})
        job.open_round, job.expected = msg.round, set(msg.clients)
        for client in job.store.early_clients(msg.round):
            if client in job.expected:
                job.store.adopt_early(msg.round, client)
                self.metrics.updates_accepted.inc()
            else:
                log.warning("update_rejected", reason="unknown_client", client=client, early=True)
                self.metrics.updates_rejected.labels("unknown_client").inc()
        job.store.drop_early(msg.round)
        # Announced here, not on arrival; again if this RoundOpen is redelivered (counted once).
        for client in job.store.stored_clients(msg.round):
            stored = job.store.read_update(msg.round, client)
            fields = stored.fields
            self._publish(UpdateAccepted(
                job_id=job.job_id, round=msg.round, client=client,
                num_examples=int(fields["num_examples"]), metrics=dict(fields.get("metrics", {})),
                train_seconds=float(fields.get("train_seconds", 0.0)),
                fetch_seconds=float(fields.get("fetch_seconds", 0.0)),
                fetch_bytes=int(fields.get("fetch_bytes", 0)), bytes=job.store.update_size(msg.round, client),
                learner=str(fields.get("learner", "")), state_tag=str(fields.get("state_tag", "")),
            ))
        log.info("round_opened", clients=len(msg.clients), stored=len(job.store.stored_clients(msg.round)))

    def accept_update(self, msg: ClientUpdate, delivery: Delivery) -> Literal["deferred"] | None:
        """Store a sound update before saying so; a redelivered one is only announced again.

        Updates that come together are stored, announced and acked together ("deferred": see
        _commit). An update for the round after the last closed one, before its RoundOpen arrives
        (broker flow control can order them so), is checked and kept on disk; the RoundOpen
        announces it. So is a large one, received into a spool file, on its own.
        """
        job = self._job(msg.job_id)
        kind = self._admit(job, msg, delivery.user_id)
        size = _size(delivery)
        if kind != "early" and delivery.body_path is None:
            if kind == "new":
                self._disk(job).need(size, f"the update of client {msg.client}")
                job.store.stage_update(msg.round, msg.client, delivery.body)
                log.info("update_accepted", client=msg.client, examples=msg.num_examples, learner=msg.learner)
            else:
                log.info("update_duplicate", client=msg.client)
            # A duplicate says its size too: the scheduler counts a client's first announcement,
            # and the first may be this one (a group whose store failed part-way, then retried).
            accepted = self._accepted(msg, size) if kind == "new" else self._accepted_again(job, msg, size)
            self._defer(job, delivery, accepted, kind == "new")
            return "deferred"
        if not self._commit(then=delivery):
            return "deferred"  # it waits behind the updates before it
        self._keep(job, msg, kind, delivery.body_path or delivery.body, size)
        if kind == "new":
            self._publish(self._accepted(msg, size))
        elif kind != "early":
            self._publish(self._accepted_again(job, msg, size))
        return None

    def accept_group(self, msg: GroupUpdate, delivery: Delivery) -> None:
        """A fused group's updates (common/groups.py): each member checked as if it had come alone,
        the scheduler told of them in UpdatesAccepted messages. All sound: the body is kept once, as
        one file. A member refused: it is counted and logged, the others are kept as single updates
        (a kept group file has no refused rows). All refused: the message is dead-lettered."""
        job = self._job(msg.job_id)
        if len(msg.members) > job.spec.clients.total:
            raise ValidationError("unknown_client", f"{len(msg.members)} members, the job has "
                                  f"{job.spec.clients.total} clients")
        updates = members(msg)
        finite = finite_rows(msg)
        admitted: list[tuple[ClientUpdate, Admitted]] = []
        refused: list[tuple[int, ValidationError]] = []
        for update, checked in zip(updates, finite, strict=True):
            try:
                admitted.append((update, self._admit(job, update, delivery.user_id, finite=checked)))
            except ValidationError as exc:
                refused.append((update.client, exc))
        if not admitted:
            raise refused[0][1]
        for client, error in refused:
            log.warning("update_rejected", client=client, reason=error.reason, detail=str(error)[:300])
            self.metrics.updates_rejected.labels(reason_label(error.reason)).inc()
        if refused or any(kind == "early" for _, kind in admitted):  # rare: each kept on its own
            self._keep_each(job, msg, admitted)
            return
        size = _size(delivery)
        if any(kind == "new" for _, kind in admitted):
            self._disk(job).need(size, f"the updates of {len(updates)} clients")
        stored = set(job.store.put_group(msg.round, delivery.body_path or delivery.body,
                                         [update.client for update in updates]))
        self.metrics.updates_accepted.inc(len(stored))
        log.info("group_accepted", clients=len(updates), stored=len(stored), learner=msg.learner)
        share = size // len(updates)  # as store.update_size says
        self._announce(msg, [self._accepted(u, share if u.client in stored else 0) for u in updates])

    def _keep_each(
        self, job: AggJob, msg: GroupUpdate, admitted: list[tuple[ClientUpdate, Admitted]]
    ) -> None:
        """A group's admitted members kept as single updates (a member was refused, or the group came
        before its RoundOpen), and announced."""
        accepted = []
        for update, kind in admitted:
            body = to_wire(update) if kind != "duplicate" else b""
            self._keep(job, update, kind, body, len(body))
            if kind != "early":
                accepted.append(self._accepted(update, len(body)))
        self._announce(msg, accepted)

    def _announce(self, msg: GroupUpdate, accepted: list[UpdateAccepted]) -> None:
        """UpdatesAccepted for a group's kept members, in messages the scheduler's frame holds."""
        for at in range(0, len(accepted), ACCEPTED_PER_MESSAGE):
            self._publish(UpdatesAccepted(job_id=msg.job_id, round=msg.round,
                                          updates=accepted[at:at + ACCEPTED_PER_MESSAGE]))

    def _admit(self, job: AggJob, msg: ClientUpdate, user_id: str | None, finite: bool = False) -> Admitted:
        """What to do with an update: ValidationError if it is refused, else how it is kept
        (`finite`: its weights are known finite, see check_update)."""
        if msg.client < job.spec.clients.total:  # a site's update comes from that site's users only
            site = job.spec.clients.site(msg.client)
            check_site_sender(site, user_id, self.settings.users_of_sites)
        if job.open_round is None and msg.round == job.round + 1:
            if msg.client >= job.spec.clients.total:
                raise ValidationError("unknown_client", f"client {msg.client} of {job.spec.clients.total}")
            kind: Admitted = "early"
        else:
            if job.open_round != msg.round:
                raise ValidationError("stale_round", f"round {msg.round} is not open")
            if msg.client not in job.expected:
                raise ValidationError("unknown_client", f"client {msg.client} was not sampled")
            if job.store.has_update(msg.round, msg.client):
                # Redelivered after it was stored: the scheduler may not have heard, so say it again
                # (it counts a client once however often it hears).
                return "duplicate"
            kind = "new"
        if msg.base_digest != job.digest:
            raise ValidationError("stale_model", "trained on another round's weights")
        check_job_update(job, msg, finite)
        return kind

    def _keep(self, job: AggJob, msg: ClientUpdate, kind: Admitted, body: bytes | Path, size: int) -> None:
        """Store an admitted update's body: in its round's updates, or kept for its RoundOpen."""
        if kind == "duplicate":
            log.info("update_duplicate", client=msg.client)
            return
        self._disk(job).need(size, f"the update of client {msg.client}")
        if kind == "early":
            job.store.put_early(msg.round, msg.client, body)
            log.info("update_early", client=msg.client, examples=msg.num_examples, learner=msg.learner)
            return
        job.store.put_update(msg.round, msg.client, body)
        self.metrics.updates_accepted.inc()
        log.info("update_accepted", client=msg.client, examples=msg.num_examples, learner=msg.learner)

    def close_round(self, msg: RoundClose) -> None:
        job = self._job(msg.job_id)
        if msg.round <= job.round and job.open_round is None:
            log.info("round_close_duplicate")  # redelivered after it took effect
            self._resend_closed(job, msg.round)
            return
        if job.open_round != msg.round:
            raise ValidationError("stale_round", f"round {msg.round} is not open")
        self._disk(job).need(model_bytes(job.weights), f"round {msg.round}'s checkpoint")
        try:
            closed = close_round(job, msg.round, msg.clients, msg.failed, self.settings.data_dir)
        except BaseException:
            rewind(job)  # the model and strategy back to the last committed round
            job.unpruned = True  # its checkpoint may be on disk, never committed
            raise
        self.models.forget(job.job_id)
        self._report(closed)
        job.store.drop_updates(msg.round)
        self._prune(job, msg.keep)

    def _prune(self, job: AggJob, keep: list[str]) -> None:
        """Old checkpoints go (FEDMQ_KEEP_CHECKPOINTS), and any never committed (a close that failed,
        a crash before its commit: looked for once after a start or a failed close). The job's disk
        is measured again every MEASURE_EVERY rounds, and every round when the job keeps per-client
        state (a strategy's, topk residuals), which the quota's count of updates does not see."""
        if self.settings.keep_checkpoints or job.unpruned:
            keep_rounds = self.settings.keep_checkpoints
            kept = retained(job.store.rounds(), job.round, keep_rounds, [job.digest, *keep])
            if gone := job.store.prune_checkpoints(kept):
                log.info("checkpoints_pruned", count=len(gone), kept=len(kept))
            job.unpruned = False
        if job.round % MEASURE_EVERY == 0 or job.strategy.sends_client_state or keeps_learner_state(job):
            self._disk(job).measure()

    def _disk(self, job: AggJob) -> DiskQuota:
        if job.disk is None:
            job.disk = DiskQuota(job.store.root, self.settings.job_disk_bytes)
        return job.disk

    # -- replies --------------------------------------------------------------

    def _accepted(self, msg: ClientUpdate, size: int) -> UpdateAccepted:
        return UpdateAccepted(
            job_id=msg.job_id, round=msg.round, client=msg.client, num_examples=msg.num_examples,
            metrics=msg.metrics, train_seconds=msg.train_seconds, fetch_seconds=msg.fetch_seconds,
            fetch_bytes=msg.fetch_bytes, bytes=size, learner=msg.learner, state_tag=msg.state_tag,
        )

    def _accepted_again(self, job: AggJob, msg: ClientUpdate, size: int) -> UpdateAccepted:
        """A duplicate's announcement, naming the stored update's learner and state (the one folded)."""
        try:
            fields = job.store.read_update(msg.round, msg.client).fields
        except Exception:  # not readable as stored: the scheduler then keeps no learner for it
            return self._accepted(msg, size).model_copy(update={"learner": "", "state_tag": ""})
        return self._accepted(msg, size).model_copy(update={
            "learner": str(fields.get("learner", "")), "state_tag": str(fields.get("state_tag", ""))})

    def _report(self, closed: RoundClosed) -> None:
        """Tell the scheduler the round is closed (its record is on disk already)."""
        self.metrics.round_metrics(closed.job_id, closed.metrics)
        self._publish(closed)
        shown = {f"{src}_{name}": round(v, 4) for src, m in closed.metrics.items() for name, v in m.items()}
        log.info("round_closed", clients=len(closed.clients), seconds=round(closed.aggregate_seconds, 4),
                 **shown)

    def _user_code_failed(self, job_id: str, exc: UserCodeError, server_round: int) -> None:
        """The job's user code raised: the job is over; the scheduler hears where and why."""
        error = exc.info("aggregator", round=server_round)
        log.warning("user_code_failed", job=job_id, phase=error.phase, error_type=error.type,
                    error=error.message[:300])
        job = self.jobs.get(job_id)
        if job is not None:
            job.failed = error
        self._publish(JobFailed(job_id=job_id, reason=error.line(), error=error))

    def _over_limit(self, job_id: str, exc: OverLimit) -> None:
        """The job passed a limit of this deployment: it is over, and the scheduler hears why."""
        reason = f"aggregator: {exc}"
        log.warning("job_over_limit", job=job_id, limit=exc.limit, reason=reason)
        self.metrics.refused(exc.limit)
        job = self.jobs.get(job_id)
        if job is not None:
            job.stopped = reason
        self._publish(JobFailed(job_id=job_id, reason=reason))

    def _resend_closed(self, job: AggJob, server_round: int) -> None:
        if job.last_closed is not None and job.last_closed.round == server_round:
            self._publish(job.last_closed)

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
