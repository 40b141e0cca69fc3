"""Aggregator handlers: build the initial model, accept updates, close rounds, serve weights.

Ack policy: every message on fedmq.aggregator is acked after its effect is on
disk and its reply published; a message that fails decoding or validation is
rejected (dead-lettered) with the reason; a duplicate update is acked with no
effect. ModelGet requests are always answered (weights or an error) and acked.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
from torch import nn

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.checkpoint import save_model
from fedmq.common.errors import DecodeError, FedmqError, ValidationError
from fedmq.common.jobspec import JobSpec, canonical_json, parse_job
from fedmq.common.messages import (
    ClientUpdate,
    JobCreate,
    JobFailed,
    Message,
    ModelGet,
    ModelReply,
    RoundClose,
    RoundClosed,
    RoundOpen,
    UpdateAccepted,
    expect,
    from_wire,
    from_wire_file,
    to_wire,
)
from fedmq.common.metrics import Metrics, reason_label
from fedmq.common.settings import Settings
from fedmq.common.workloads.datasets import load_dataset
from fedmq.common.workloads.models import build_model
from fedmq.services.aggregator.evaluation import evaluate
from fedmq.services.aggregator.store import JobStore
from fedmq.services.aggregator.strategies import ClientResult, Strategy, build_strategy
from fedmq.services.aggregator.validation import check_update

log = structlog.get_logger("fedmq.aggregator")

# The encoded global model is kept for repeat fetches only while small: a large one would
# cost another copy of the model for the whole round.
REPLY_CACHE_BYTES = 64 * 1024 * 1024


def _views(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors (no copy): the global weights live once, in the model."""
    return {k: v.detach() for k, v in model.state_dict().items()}


@dataclass
class AggJob:
    """The aggregator's view of one job: its current global model and the open round."""

    spec: JobSpec
    store: JobStore
    strategy: Strategy
    model: nn.Module
    x_test: torch.Tensor
    y_test: torch.Tensor
    train_size: int
    weights: dict[str, torch.Tensor]
    digest: str
    round: int = 0
    open_round: int | None = None
    expected: set[int] = field(default_factory=set)
    reply_cache: tuple[str, bytes] | None = None
    last_closed: RoundClosed | None = None  # re-sent when its trigger is redelivered


class AggregatorService:
    def __init__(self, settings: Settings, bus: Bus, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.bus = bus
        self.metrics = metrics or Metrics()
        self.root = Path(settings.state_dir) / "aggregator"
        self.jobs: dict[str, AggJob] = {}

    def start(self) -> None:
        # Updates bigger than a frame are received straight into files: memory holds one chunk.
        # Files a previous run left half-received belong to messages the broker still holds.
        shutil.rmtree(self.root / "spool", ignore_errors=True)
        self._resume()
        self.bus.consume(topology.AGGREGATOR, self.on_message, prefetch=1, spool=self.root / "spool")
        self.bus.consume(topology.MODEL, self.on_model_get, prefetch=4)

    def _resume(self) -> None:
        """Rebuild every job found on disk from its spec, latest checkpoint and round records."""
        if not self.root.is_dir():
            return
        for path in sorted(self.root.iterdir()):
            store = JobStore(self.root, path.name)
            spec_json = store.load_spec() if path.is_dir() else None
            if spec_json is None or not store.rounds():
                continue
            job = self._restore(path.name, JobSpec.model_validate_json(spec_json), store)
            self.jobs[path.name] = job
            log.info("job_resumed", job=path.name, round=job.round, open_round=job.open_round)

    def _restore(self, job_id: str, spec: JobSpec, store: JobStore) -> AggJob:
        job = self._assemble(job_id, spec, store)
        latest = max(store.rounds())
        weights, extra = store.load_checkpoint(store.rounds()[latest])
        job.model.load_state_dict(weights)
        job.strategy.load_state(extra)
        job.weights, job.digest, job.round = _views(job.model), store.rounds()[latest], latest
        opened = store.load_json("open")
        if opened is not None and opened["round"] == latest + 1:
            job.open_round, job.expected = opened["round"], set(opened["clients"])
        closed = store.load_json("closed")
        if closed is not None and closed["round"] == latest:
            job.last_closed = RoundClosed.model_validate(closed)
        return job

    # -- dispatch -------------------------------------------------------------

    def on_message(self, delivery: Delivery) -> None:
        try:
            if delivery.body_path is not None:
                msg = from_wire_file(delivery.body_path, max_bytes=self.settings.max_message_bytes)
            else:
                msg = from_wire(delivery.body, max_bytes=self.settings.max_message_bytes)
        except DecodeError as exc:
            self._reject(delivery, "decode", str(exc))
            return
        try:
            with structlog.contextvars.bound_contextvars(
                job=msg.job_id, round=getattr(msg, "round", None), client=getattr(msg, "client", None)
            ):
                self._handle(msg, delivery)
        except (DecodeError, ValidationError) as exc:
            reason = exc.reason if isinstance(exc, ValidationError) else "decode"
            if isinstance(msg, ClientUpdate):
                self.metrics.updates_rejected.labels(reason_label(reason)).inc()
            self._reject(delivery, reason, getattr(exc, "detail", str(exc)))
            return
        delivery.ack()

    def _reject(self, delivery: Delivery, reason: str, detail: str) -> None:
        log.warning("message_rejected", reason=reason, detail=detail[:500])
        delivery.reject(f"{reason}: {detail}")

    def _handle(self, msg: Message, delivery: Delivery) -> None:
        match msg:
            case JobCreate():
                self.create_job(msg)
            case RoundOpen():
                self.open_round(msg)
            case ClientUpdate():
                self.accept_update(msg, delivery)
            case RoundClose():
                self.close_round(msg)
            case _:
                raise ValidationError("unexpected_type", msg.type)  # type: ignore[attr-defined]

    # -- handlers -------------------------------------------------------------

    def create_job(self, msg: JobCreate) -> None:
        if msg.job_id in self.jobs:
            log.info("job_create_duplicate")
            self._resend_closed(self.jobs[msg.job_id], 0)
            return
        try:
            spec = parse_job(msg.spec)
            job = self._build_job(msg.job_id, spec)
        except FedmqError as exc:
            log.warning("job_create_failed", error=str(exc))
            self._publish(JobFailed(job_id=msg.job_id, reason=f"aggregator: {exc}"))
            return
        self.jobs[msg.job_id] = job
        self._report(job, RoundClosed(
            job_id=job.store.job_id, round=0, model_digest=job.digest, test_loss=0, test_accuracy=0
        ), seconds=0.0)

    def _build_job(self, job_id: str, spec: JobSpec) -> AggJob:
        store = JobStore(self.root, job_id)
        job = self._assemble(job_id, spec, store)
        store.save_spec(canonical_json(spec))
        job.digest = store.save_checkpoint(0, job.weights, {})
        log.info("job_created", params=sum(v.numel() for v in job.weights.values()), digest=job.digest[:12])
        return job

    def _assemble(self, job_id: str, spec: JobSpec, store: JobStore) -> AggJob:
        """A job's model, data and strategy as built from its spec (initial weights)."""
        data = load_dataset(spec.data, spec.seed)
        model = build_model(spec.model, data.input_shape, data.num_classes, spec.seed)
        return AggJob(
            spec=spec,
            store=store,
            strategy=build_strategy(spec),
            model=model,
            x_test=torch.tensor(data.x_test),
            y_test=torch.tensor(data.y_test),
            train_size=len(data.y_train),
            weights=_views(model),
            digest="",
        )

    def open_round(self, msg: RoundOpen) -> None:
        job = self._job(msg.job_id)
        if msg.round != job.round + 1:
            raise ValidationError("stale_round", f"round {msg.round} opened after round {job.round}")
        job.store.save_json("open", {"round": msg.round, "clients": sorted(msg.clients)})
        job.open_round, job.expected = msg.round, set(msg.clients)
        log.info("round_opened", clients=len(msg.clients))

    def accept_update(self, msg: ClientUpdate, delivery: Delivery) -> None:
        job = self._job(msg.job_id)
        if job.open_round != msg.round:
            raise ValidationError("stale_round", f"round {msg.round} is not open")
        if msg.client not in job.expected:
            raise ValidationError("unknown_client", f"client {msg.client} was not sampled")
        if job.store.has_update(msg.round, msg.client):
            # Redelivered after it was stored: the scheduler may not have heard, so say it again
            # (it counts a client once however often it hears).
            log.info("update_duplicate")
            self._accepted(msg)
            return
        if msg.base_digest != job.digest:
            raise ValidationError("stale_model", "trained on another round's weights")
        check_update(msg, job.weights, max_examples=job.train_size)
        job.store.put_update(msg, delivery.body_path or delivery.body)
        self._accepted(msg)
        self.metrics.updates_accepted.inc()
        log.info("update_accepted", examples=msg.num_examples, learner=msg.learner)

    def _accepted(self, msg: ClientUpdate) -> None:
        self._publish(UpdateAccepted(
            job_id=msg.job_id, round=msg.round, client=msg.client,
            num_examples=msg.num_examples, metrics=msg.metrics,
        ))

    def close_round(self, msg: RoundClose) -> None:
        job = self._job(msg.job_id)
        if msg.round <= job.round and job.open_round is None:
            log.info("round_close_duplicate")  # redelivered after it took effect
            self._resend_closed(job, msg.round)
            return
        if job.open_round != msg.round:
            raise ValidationError("stale_round", f"round {msg.round} is not open")
        started = time.perf_counter()
        results = job.store.results(msg.round, msg.clients)
        new = job.strategy.aggregate(msg.round, job.weights, results)
        job.model.load_state_dict(new)  # copies into the parameters, dtypes kept
        del new
        job.weights = _views(job.model)
        job.reply_cache = None
        job.digest = job.store.save_checkpoint(msg.round, job.weights, job.strategy.state())
        job.round, job.open_round, job.expected = msg.round, None, set()
        examples = sum(r.num_examples for r in results)
        closed = RoundClosed(
            job_id=msg.job_id,
            round=msg.round,
            model_digest=job.digest,
            clients=[r.client for r in results],
            num_examples=examples,
            test_loss=0,
            test_accuracy=0,
            train_loss=_weighted(results, "loss"),
            train_accuracy=_weighted(results, "accuracy"),
        )
        if msg.round == job.spec.rounds:
            path = save_model(
                job.store.root / "model.safetensors", job.weights, canonical_json(job.spec),
                job_id=msg.job_id, round=msg.round,
            )
            closed = closed.model_copy(update={"model_path": str(path)})
        self._report(job, closed, seconds=time.perf_counter() - started)
        job.store.drop_updates(msg.round)

    def _report(self, job: AggJob, closed: RoundClosed, seconds: float) -> None:
        """Evaluate the new global model and tell the scheduler the round is closed."""
        loss, accuracy = evaluate(job.model, job.x_test, job.y_test)
        closed = closed.model_copy(
            update={"test_loss": loss, "test_accuracy": accuracy, "aggregate_seconds": seconds}
        )
        job.last_closed = closed
        job.store.save_json("closed", closed.model_dump())  # before it is announced
        self._publish(closed)
        log.info("round_closed", accuracy=round(accuracy, 4), loss=round(loss, 4),
                 clients=len(closed.clients), seconds=round(seconds, 4))

    def _resend_closed(self, job: AggJob, server_round: int) -> None:
        if job.last_closed is not None and job.last_closed.round == server_round:
            self._publish(job.last_closed)

    def on_model_get(self, delivery: Delivery) -> None:
        try:
            req = expect(from_wire(delivery.body, max_bytes=1024 * 1024), ModelGet)
        except DecodeError as exc:
            self._reject(delivery, "decode", str(exc))
            return
        self.bus.reply(delivery, self._model_reply(req))
        delivery.ack()

    def _model_reply(self, req: ModelGet) -> bytes:
        job = self.jobs.get(req.job_id)
        if job is None:
            return to_wire(ModelReply(job_id=req.job_id, digest=req.digest, error="unknown job"))
        if job.reply_cache is not None and job.reply_cache[0] == req.digest:
            return job.reply_cache[1]
        if req.digest == job.digest:
            weights: Mapping[str, torch.Tensor] = job.weights
        elif job.store.checkpoint_path(req.digest).exists():
            weights = job.store.load_checkpoint(req.digest)[0]
        else:
            return to_wire(ModelReply(job_id=req.job_id, digest=req.digest, error="unknown model"))
        body = to_wire(ModelReply(job_id=req.job_id, digest=req.digest, weights=dict(weights)))
        if req.digest == job.digest and len(body) <= REPLY_CACHE_BYTES:
            job.reply_cache = (req.digest, body)
        return body

    # -- helpers --------------------------------------------------------------

    def _job(self, job_id: str) -> AggJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise ValidationError("unknown_job", job_id)
        return job

    def _publish(self, msg: Message) -> None:
        self.bus.publish(topology.SCHEDULER, to_wire(msg))


def _weighted(results: list[ClientResult], key: str) -> float | None:
    pairs = [(r.metrics[key], r.num_examples) for r in results if key in r.metrics]
    total = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / total if total else None

