"""Keeping admitted updates (admission.py decides which) in the job's store, and what the scheduler
is told of them.

    "new"        the round's updates (store.put_update; a group's body once: store.put_group)
    "early"      kept for its RoundOpen (store.put_early), then adopted or dropped: adopt_early
    "duplicate"  nothing written; announced again (the scheduler counts a client once)

Each write first asks the job's disk quota (pruning.Pruner.disk) for its size. What is returned is
the UpdateAccepted the caller publishes, or UpdatesAccepted for a group, in messages the
scheduler's frame holds; the group commit (commit.py) announces the staged ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import structlog

from fedmq.common.messages import ClientUpdate, GroupUpdate, UpdateAccepted, UpdatesAccepted, to_wire
from fedmq.common.metrics import Metrics
from fedmq.services.aggregator.admission import Admitted
from fedmq.services.aggregator.jobs import AggJob
from fedmq.services.aggregator.pruning import Pruner

log = structlog.get_logger("fedmq.aggregator")

ACCEPTED_PER_MESSAGE = 1000  # about 300 bytes each: far under the scheduler's frame


def accepted(msg: ClientUpdate, size: int) -> UpdateAccepted:
    """What the scheduler hears of a kept update (`size`: its bytes as stored)."""
    return UpdateAccepted(
        job_id=msg.job_id, round=msg.round, client=msg.client, num_examples=msg.num_examples,
        metrics=msg.metrics, train_seconds=msg.train_seconds, fetch_seconds=msg.fetch_seconds,
        fetch_bytes=msg.fetch_bytes, bytes=size, learner=msg.learner, state_tag=msg.state_tag,
    )


def accepted_again(job: AggJob, msg: ClientUpdate, size: int) -> UpdateAccepted:
    """A duplicate's announcement, naming the stored update's learner and state (the one folded)."""
    try:
        fields = job.store.read_update(msg.round, msg.client).fields
    except Exception:  # not readable as stored: the scheduler then keeps no learner for it
        return accepted(msg, size).model_copy(update={"learner": "", "state_tag": ""})
    return accepted(msg, size).model_copy(update={
        "learner": str(fields.get("learner", "")), "state_tag": str(fields.get("state_tag", ""))})


def announcements(msg: GroupUpdate, kept: list[UpdateAccepted]) -> list[UpdatesAccepted]:
    """UpdatesAccepted for a group's kept members, in messages the scheduler's frame holds."""
    return [UpdatesAccepted(job_id=msg.job_id, round=msg.round, updates=part) for part in in_messages(kept)]


def in_messages(replies: list[UpdateAccepted]) -> list[list[UpdateAccepted]]:
    """A round's announcements in parts of ACCEPTED_PER_MESSAGE, one message each."""
    return [replies[at:at + ACCEPTED_PER_MESSAGE] for at in range(0, len(replies), ACCEPTED_PER_MESSAGE)]


class Intake:
    """Admitted updates into their job's store, counted in the metrics and logged."""

    def __init__(self, pruner: Pruner, metrics: Metrics) -> None:
        self.pruner = pruner
        self.metrics = metrics

    def keep(self, job: AggJob, msg: ClientUpdate, kind: Admitted, body: bytes | Path, size: int) -> None:
        """Store an admitted update's body: in its round's updates, or kept for its RoundOpen."""
        if kind == "duplicate":
            log.info("update_duplicate", client=msg.client)
            return
        self.pruner.disk(job).need(size, f"the update of client {msg.client}")
        if kind == "early":
            job.store.put_early(msg.round, msg.client, body)
            log.info("update_early", client=msg.client, examples=msg.num_examples, learner=msg.learner)
            return
        job.store.put_update(msg.round, msg.client, body)
        self.metrics.updates_accepted.inc()
        log.info("update_accepted", client=msg.client, examples=msg.num_examples, learner=msg.learner)

    def keep_group(
        self, job: AggJob, msg: GroupUpdate, updates: list[ClientUpdate],
        admitted: list[tuple[ClientUpdate, Admitted]], body: bytes | Path, size: int,
    ) -> list[UpdatesAccepted]:
        """A group's admitted members: its body kept once when every member is admitted for the open
        round, else each member kept as a single update (a kept group file has no refused rows)."""
        if len(admitted) < len(updates) or any(kind == "early" for _, kind in admitted):  # rare
            return self._keep_each(job, msg, admitted)
        replies, stored = self._group(job, msg, admitted, size,
                                      lambda clients: job.store.put_group(msg.round, body, clients))
        self.metrics.updates_accepted.inc(stored)
        return announcements(msg, replies)

    def stage_group(
        self, job: AggJob, msg: GroupUpdate, admitted: list[tuple[ClientUpdate, Admitted]], body: bytes,
        size: int,
    ) -> tuple[list[UpdateAccepted], int]:
        """As keep_group for a group whose every member is admitted for the open round: its body
        staged, to be stored by the next group commit (commit.GroupCommit) with what came with it.
        Its members' announcements, and how many it stores."""
        return self._group(job, msg, admitted, size,
                           lambda clients: job.store.stage_group(msg.round, body, clients))

    def _group(
        self, job: AggJob, msg: GroupUpdate, admitted: list[tuple[ClientUpdate, Admitted]], size: int,
        keep: Callable[[list[int]], list[int]],
    ) -> tuple[list[UpdateAccepted], int]:
        """A whole group's body kept (`keep`: put or staged; it returns the members it stores): its
        members' announcements, and how many it stores."""
        updates = [update for update, _ in admitted]
        if any(kind == "new" for _, kind in admitted):
            self.pruner.disk(job).need(size, f"the updates of {len(updates)} clients")
        stored = set(keep([update.client for update in updates]))
        log.info("group_accepted", clients=len(updates), stored=len(stored), learner=msg.learner)
        share = size // len(updates)  # as store.update_size says
        return [accepted(u, share if u.client in stored else 0) for u in updates], len(stored)

    def _keep_each(
        self, job: AggJob, msg: GroupUpdate, admitted: list[tuple[ClientUpdate, Admitted]]
    ) -> list[UpdatesAccepted]:
        """A group's admitted members kept as single updates (a member was refused, or the group came
        before its RoundOpen)."""
        kept = []
        for update, kind in admitted:
            body = to_wire(update) if kind != "duplicate" else b""
            self.keep(job, update, kind, body, len(body))
            if kind != "early":
                kept.append(accepted(update, len(body)))
        return announcements(msg, kept)

    def adopt_early(self, job: AggJob, server_round: int) -> None:
        """The round just opened: the updates that came before it, of its sampled clients, become
        its updates; the others are refused."""
        for client in job.store.early_clients(server_round):
            if client in job.expected:
                job.store.adopt_early(server_round, client)
                self.metrics.updates_accepted.inc()
            else:
                log.warning("update_rejected", reason="unknown_client", client=client, early=True)
                self.metrics.updates_rejected.labels("unknown_client").inc()
        job.store.drop_early(server_round)


def stored(job: AggJob, server_round: int) -> Iterator[UpdateAccepted]:
    """What the scheduler hears of each update stored for the round, read one at a time."""
    for client in job.store.stored_clients(server_round):
        fields = job.store.read_update(server_round, client).fields
        yield UpdateAccepted(
            job_id=job.job_id, round=server_round, client=client,
            num_examples=int(fields["num_examples"]), metrics=dict(fields.get("metrics", {})),
            train_seconds=float(fields.get("train_seconds", 0.0)),
            fetch_seconds=float(fields.get("fetch_seconds", 0.0)),
            fetch_bytes=int(fields.get("fetch_bytes", 0)), bytes=job.store.update_size(server_round, client),
            learner=str(fields.get("learner", "")), state_tag=str(fields.get("state_tag", "")),
        )
