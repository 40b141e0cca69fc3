"""Admission: whether an update may be kept, and how, before anything of it is stored.

    ClientUpdate ─▶ admit:
        a site's client, from another broker user than the site's   refused "sender"
        round after the last closed, before its RoundOpen            "early" (kept for the RoundOpen)
        not the open round / client not sampled                      refused stale_round / unknown_client
        already stored for (job, round, client)                      "duplicate" (announced again)
        trained on other weights than the round's                    refused stale_model
        else its content (validation.check_job_update)               "new", or refused with its reason
    GroupUpdate ─▶ admit_group: each member as if it had come alone; refused members logged, counted

The caller stores what is admitted (common/groups.py for a group's body) and acks.
"""

from __future__ import annotations

from typing import Literal

import structlog

from fedmq.common.errors import ValidationError
from fedmq.common.groups import finite_rows, members
from fedmq.common.messages import ClientUpdate, GroupUpdate
from fedmq.common.metrics import Metrics, reason_label
from fedmq.common.senders import check_site_sender
from fedmq.common.settings import Settings
from fedmq.services.aggregator.jobs import AggJob
from fedmq.services.aggregator.validation import check_job_update

log = structlog.get_logger("fedmq.aggregator")

Admitted = Literal["new", "early", "duplicate"]  # how an update that passed its checks is kept


class Admission:
    """The checks on an update before it is accepted."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics

    def admit(self, job: AggJob, msg: ClientUpdate, user_id: str | None, finite: bool = False) -> Admitted:
        """What to do with an update: ValidationError if it is refused, else how it is kept
        (`finite`: its weights are known finite, see check_update)."""
        self.check_sender(job, msg.client, user_id)
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

    def check_sender(self, job: AggJob, client: int, user_id: str | None) -> None:
        """ValidationError unless `user_id` may send this client's update: a site's come from
        that site's users only."""
        if client < job.spec.clients.total:
            check_site_sender(job.spec.clients.site(client), user_id, self.settings.users_of_sites)

    def admit_group(
        self, job: AggJob, msg: GroupUpdate, user_id: str | None
    ) -> tuple[list[ClientUpdate], list[tuple[ClientUpdate, Admitted]]]:
        """A fused group's members (common/groups.py), and those admitted with how each is kept.
        Each refused member is logged and counted; all refused: the first's ValidationError."""
        if len(msg.members) > job.spec.clients.total:
            raise ValidationError("unknown_client", f"{len(msg.members)} members, the job has "
                                  f"{job.spec.clients.total} clients")
        updates = members(msg)
        finite = finite_rows(msg)
        admitted: list[tuple[ClientUpdate, Admitted]] = []
        refused: list[tuple[int, ValidationError]] = []
        for update, checked in zip(updates, finite, strict=True):
            try:
                admitted.append((update, self.admit(job, update, user_id, finite=checked)))
            except ValidationError as exc:
                refused.append((update.client, exc))
        if not admitted:
            raise refused[0][1]
        for client, error in refused:
            log.warning("update_rejected", client=client, reason=error.reason, detail=str(error)[:300])
            self.metrics.updates_rejected.labels(reason_label(error.reason)).inc()
        return updates, admitted
