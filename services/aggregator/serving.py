"""Serving global weights: learners ask on fedmq.model (ModelGet) and get a ModelReply back.

Ack policy: every request that decodes is answered (the weights, or an error
naming the unknown job or model) and acked; one that does not decode is
rejected (dead-lettered) with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog

from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.errors import DecodeError
from fedmq.common.messages import ModelGet, ModelReply, expect, from_wire, to_wire
from fedmq.services.aggregator.jobs import AggJob

log = structlog.get_logger("fedmq.aggregator")

# The encoded global model is kept for repeat fetches only while small: a large one would
# cost another copy of the model for the whole round.
REPLY_CACHE_BYTES = 64 * 1024 * 1024


class ModelServer:
    """Answers ModelGet from the aggregator's jobs: the current model, or an older one by digest."""

    def __init__(self, bus: Bus, jobs: Mapping[str, AggJob]) -> None:
        self.bus = bus
        self.jobs = jobs
        self._cache: dict[str, tuple[str, bytes]] = {}  # job → (digest, reply) of its current model

    def on_model_get(self, delivery: Delivery) -> None:
        try:
            req = expect(from_wire(delivery.body, max_bytes=1024 * 1024), ModelGet)
        except DecodeError as exc:
            log.warning("message_rejected", reason="decode", detail=str(exc)[:500])
            delivery.reject(f"decode: {exc}")
            return
        self.bus.reply(delivery, self.reply(req))
        delivery.ack()

    def reply(self, req: ModelGet) -> bytes:
        """The encoded ModelReply for `req`."""
        job = self.jobs.get(req.job_id)
        if job is None:
            return to_wire(ModelReply(job_id=req.job_id, digest=req.digest, error="unknown job"))
        if req.digest == job.digest:
            return self._current(job)
        if job.store.checkpoint_path(req.digest).exists():
            weights = job.store.load_checkpoint(req.digest)[0]
            return to_wire(ModelReply(job_id=req.job_id, digest=req.digest, weights=weights))
        return to_wire(ModelReply(job_id=req.job_id, digest=req.digest, error="unknown model"))

    def forget(self, job_id: str) -> None:
        """The job's model changed: drop the reply kept for the old one."""
        self._cache.pop(job_id, None)

    def _current(self, job: AggJob) -> bytes:
        """The reply for the job's current model, encoded once per round while it is small."""
        cached = self._cache.get(job.job_id)
        if cached is not None and cached[0] == job.digest:
            return cached[1]
        body = to_wire(ModelReply(job_id=job.job_id, digest=job.digest, weights=dict(job.weights)))
        if len(body) <= REPLY_CACHE_BYTES:
            self._cache[job.job_id] = (job.digest, body)
        return body
