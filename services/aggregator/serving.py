"""Serving global weights: learners ask on fedmq.model (ModelGet) and get a ModelReply back; the same
queue serves a client's stored strategy state (ClientStateGet → ClientStateReply).

Ack policy: every request that decodes is answered (the weights, or an error
naming the unknown job or model) and acked; one that does not decode is
rejected (dead-lettered) with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import structlog

from fedmq.common.bus.base import Body, Bus, Delivery
from fedmq.common.codec.compress import Downlink, downlinked
from fedmq.common.errors import DecodeError, ValidationError
from fedmq.common.messages import (
    ClientStateGet,
    ClientStateReply,
    Message,
    ModelGet,
    ModelReply,
    from_wire,
    to_wire,
    to_wire_parts,
)
from fedmq.common.senders import check_sender, check_site_sender
from fedmq.common.statefiles import JOB_ID
from fedmq.services.aggregator.jobs import AggJob
from fedmq.services.aggregator.store import JobStore

log = structlog.get_logger("fedmq.aggregator")

# The encoded global model is kept for repeat fetches only while small: a large one would
# cost another copy of the model for the whole round. A large one is sent from its encoded
# parts, which view the model's own tensors: never a copy of the model at all.
REPLY_CACHE_BYTES = 64 * 1024 * 1024


class ModelServer:
    """Answers ModelGet from the aggregator's jobs: the current model, or an older one by digest."""

    def __init__(
        self, bus: Bus, jobs: Mapping[str, AggJob], senders: Mapping[str, frozenset[str]],
        users_of_sites: Mapping[str, frozenset[str]] | None = None, ddp_root: Path | None = None,
    ) -> None:
        self.bus = bus
        self.jobs = jobs
        self.senders = senders  # role → broker users (Settings.role_users)
        self.users_of_sites = users_of_sites or {}  # a site's state goes to its own users only
        self.ddp_root = ddp_root  # DDP jobs' checkpoints and models: stores with no round loop
        self._cache: dict[str, tuple[str, str, bytes]] = {}  # job → (digest, downlink, reply) of its model

    def on_model_get(self, delivery: Delivery) -> None:
        try:
            req = _request(from_wire(delivery.body, max_bytes=1024 * 1024))
        except DecodeError as exc:
            log.warning("message_rejected", reason="decode", detail=str(exc)[:500])
            delivery.reject(f"decode: {exc}")
            return
        try:
            check_sender(req.type, delivery.user_id, self.senders)
        except ValidationError as exc:
            log.warning("message_rejected", reason=exc.reason, detail=exc.detail[:500])
            delivery.reject(str(exc))
            return
        body = self.reply(req) if isinstance(req, ModelGet) else self.client_state(req, delivery.user_id)
        self.bus.reply(delivery, body)
        delivery.ack()

    def reply(self, req: ModelGet) -> Body:
        """The encoded ModelReply for `req`."""
        job = self.jobs.get(req.job_id)
        if job is None:
            return self._ddp_reply(req)
        if req.digest == job.digest:
            return self._current(job, req.downlink)
        if job.store.find_weights(req.digest) is not None:
            weights = downlinked(job.store.load_weights(req.digest), req.downlink)
            return to_wire_parts(ModelReply(job_id=req.job_id, digest=req.digest, weights=weights))
        return to_wire(ModelReply(job_id=req.job_id, digest=req.digest, error="unknown model"))

    def _ddp_reply(self, req: ModelGet) -> Body:
        """A DDP job's checkpoint or model by digest; 'unknown job' for anything else."""
        if self.ddp_root is not None and JOB_ID.fullmatch(req.job_id):
            store = JobStore(self.ddp_root, req.job_id)
            if store.find_weights(req.digest) is not None:
                weights = store.load_weights(req.digest)
                return to_wire_parts(ModelReply(job_id=req.job_id, digest=req.digest, weights=weights))
        return to_wire(ModelReply(job_id=req.job_id, digest=req.digest, error="unknown job"))

    def client_state(self, req: ClientStateGet, user_id: str | None = None) -> bytes:
        """The encoded ClientStateReply: the client's newest state before the round ({} if none).

        A site's state (control variates, compression's residual) is derived from its data: it
        goes only to the broker users FEDMQ_SITE_USERS gives that site."""
        reply = ClientStateReply(job_id=req.job_id, round=req.round, client=req.client)
        job = self.jobs.get(req.job_id)
        if job is None:
            return to_wire(reply.model_copy(update={"error": "unknown job"}))
        if req.client >= job.spec.clients.total or req.round > job.round + 1:
            error = f"no state for client {req.client} in round {req.round}"
            return to_wire(reply.model_copy(update={"error": error}))
        site = job.spec.clients.site(req.client)
        if site is not None and user_id not in self.senders.get("learner", frozenset()):
            # Derived from the site's data: only a learner may ask (and of a listed site, its own).
            error = f"site_sender: client {req.client} is site {site!r}: its state goes to its learners only"
            log.warning("message_rejected", reason="site_sender", detail=error[:500])
            return to_wire(reply.model_copy(update={"error": error}))
        try:
            check_site_sender(site, user_id, self.users_of_sites)
        except ValidationError as exc:
            log.warning("message_rejected", reason=exc.reason, detail=exc.detail[:500])
            return to_wire(reply.model_copy(update={"error": f"site_sender: {exc.detail}"}))
        state = job.clients.read(req.client, before=req.round)
        state |= job.residuals.read(req.client, before=req.round)  # compression's residual, if any
        return to_wire(reply.model_copy(update={"state": state}))

    def forget(self, job_id: str) -> None:
        """The job's model changed: drop the reply kept for the old one."""
        self._cache.pop(job_id, None)

    def _current(self, job: AggJob, downlink: Downlink) -> Body:
        """The reply for the job's current model (rounded as `downlink` says), encoded once per round
        while it is small; a large one in parts viewing the model (or its rounded copy), sent before
        this (the loop) thread can change the model."""
        cached = self._cache.get(job.job_id)
        if cached is not None and cached[:2] == (job.digest, downlink):
            return cached[2]
        weights = downlinked(job.weights, downlink)
        parts = to_wire_parts(ModelReply(job_id=job.job_id, digest=job.digest, weights=weights))
        if parts.size > REPLY_CACHE_BYTES:
            return parts
        body = parts.join()
        self._cache[job.job_id] = (job.digest, downlink, body)
        return body


def _request(msg: Message) -> ModelGet | ClientStateGet:
    if isinstance(msg, ModelGet | ClientStateGet):
        return msg
    raise DecodeError(f"unexpected message type {msg.type!r}")  # type: ignore[attr-defined]
