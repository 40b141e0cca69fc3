"""A round the aggregator closes itself: every client's update stored, and the RoundOpen let it.

The scheduler's RoundClose would name every client and no failure; the aggregator folds the same
updates the same way, so the model is the same bits. The announcement of the last updates says the
round is closed (UpdatesAccepted.closed) and its RoundClosed follows in the same publish. An update
of that round that comes again (its ack lost with a crash or a failed publish) brings the
RoundClosed again and changes nothing.
"""

from __future__ import annotations

import errno
import queue
from typing import Any

import pytest
import torch

from fedmq.common.errors import StateUnwritable
from fedmq.common.messages import JobCreate, Message, RoundClose, RoundClosed, RoundOpen, UpdatesAccepted
from fedmq.services.aggregator import service
from fedmq.services.aggregator.jobs import AggJob
from tests.integration.conftest import Transport
from tests.integration.test_group_commit import CLIENTS, Cluster, announced, replies_until_closed, wait_for

QUIET = 0.5  # how long the stand-in scheduler listens for a RoundClosed that must not come


def opened_to_close_itself(cluster: Cluster) -> tuple[str, dict[str, torch.Tensor]]:
    """As Cluster.open_round_one, the RoundOpen letting the aggregator close the round."""
    cluster.send(JobCreate(job_id=cluster.job_id, spec=cluster.spec.model_dump(mode="json")))
    created = cluster.reply()
    assert isinstance(created, RoundClosed) and created.round == 0, created
    cluster.send(RoundOpen(job_id=cluster.job_id, round=1, clients=CLIENTS, close_when_complete=True))
    return created.model_digest, dict(cluster.aggregator.jobs[cluster.job_id].weights)


def nothing_more(cluster: Cluster) -> Message | None:
    try:
        return cluster.replies.get(timeout=QUIET)
    except queue.Empty:
        return None


def test_the_last_update_closes_the_round_as_the_scheduler_would(transport: Transport) -> None:
    with Cluster(transport).running() as cluster:
        digest, weights = cluster.open_round_one()  # opened without close_when_complete
        cluster.while_busy(lambda: cluster.send(*cluster.updates(digest, weights)))
        assert announced(cluster.reply()) == CLIENTS
        assert nothing_more(cluster) is None, "closed without being asked"
        cluster.send(RoundClose(job_id=cluster.job_id, round=1, clients=CLIENTS))
        asked = cluster.reply()
        assert isinstance(asked, RoundClosed)

        cluster.job_id = "closes-itself"  # the same job again, its RoundOpen letting it close
        digest, weights = opened_to_close_itself(cluster)
        updates = cluster.updates(digest, weights)
        cluster.send(*updates[:2])
        cluster.while_busy(lambda: cluster.send(*updates[2:]))
        replies = []
        while not isinstance(reply := cluster.reply(), RoundClosed):
            replies.append(reply)
        assert sorted(c for r in replies for c in announced(r)) == CLIENTS
        last = replies[-1]
        assert isinstance(last, UpdatesAccepted) and last.closed, last
        assert not any(getattr(r, "closed", False) for r in replies[:-1])
        assert reply.round == 1 and reply.clients == CLIENTS
        assert reply.model_digest == asked.model_digest, "the same close, the same bits"
        folder = cluster.aggregator.root / cluster.job_id / "updates" / "r1"
        wait_for(lambda: not folder.exists())  # dropped once the RoundClosed is out
    assert transport.dead() == []


def test_an_update_of_a_round_it_closed_brings_the_round_closed_again(transport: Transport) -> None:
    with Cluster(transport).running() as cluster:
        digest, weights = opened_to_close_itself(cluster)
        updates = cluster.updates(digest, weights)
        cluster.send(*updates)
        clients, closed = replies_until_closed(cluster)
        assert sorted(clients) == CLIENTS
        # Its ack lost: the broker gives it again after the close.
        cluster.send(updates[3])
        again = cluster.reply()
        assert isinstance(again, RoundClosed) and again.model_digest == closed.model_digest
        assert again.round == 1
        job = cluster.aggregator.jobs[cluster.job_id]
        assert job.round == 1 and job.open_round is None
    assert transport.dead() == [], "acked: it was folded, not refused as stale"


def test_a_round_missing_a_client_waits_for_the_scheduler(transport: Transport) -> None:
    with Cluster(transport).running() as cluster:
        digest, weights = opened_to_close_itself(cluster)
        updates = cluster.updates(digest, weights)
        cluster.while_busy(lambda: cluster.send(*updates[:-1]))
        first = cluster.reply()
        assert announced(first) == CLIENTS[:-1] and not getattr(first, "closed", False)
        assert nothing_more(cluster) is None, "closed before every client"
        cluster.send(RoundClose(job_id=cluster.job_id, round=1, clients=CLIENTS[:-1]))
        closed = cluster.reply()
        assert isinstance(closed, RoundClosed) and closed.clients == CLIENTS[:-1]
    assert transport.dead() == []


def test_a_restarted_aggregator_says_its_last_close_again(transport: Transport) -> None:
    """The scheduler may never have heard of a close the aggregator made itself (on the in-memory
    bus, the update that would bring it again dies with the process): a start says it again."""
    with Cluster(transport).running() as cluster:
        digest, weights = opened_to_close_itself(cluster)
        cluster.send(*cluster.updates(digest, weights))
        _, closed = replies_until_closed(cluster)
    with Cluster(transport).running() as restarted:
        again = restarted.reply()
        assert isinstance(again, RoundClosed)
        assert (again.round, again.model_digest) == (1, closed.model_digest)
        assert nothing_more(restarted) is None
    assert transport.dead() == []


def test_a_round_half_stored_before_a_restart_still_closes_itself(transport: Transport) -> None:
    with Cluster(transport).running() as cluster:
        digest, weights = opened_to_close_itself(cluster)
        updates = cluster.updates(digest, weights)
        cluster.while_busy(lambda: cluster.send(*updates[:2]))
        assert announced(cluster.reply()) == CLIENTS[:2]
    with Cluster(transport).running() as restarted:
        restarted.send(*updates[2:])
        clients, closed = replies_until_closed(restarted)
        assert set(clients) == set(CLIENTS[2:]) and closed.clients == CLIENTS
    assert transport.dead() == []


def test_a_close_that_fails_here_is_left_to_the_scheduler(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = service.close_round
    failures: list[int] = []

    def full_disk_once(job: AggJob, server_round: int, *args: Any) -> RoundClosed:
        if not failures:
            failures.append(server_round)
            raise StateUnwritable("checkpoint", errno.ENOSPC, "no space left on device")
        return real(job, server_round, *args)

    monkeypatch.setattr(service, "close_round", full_disk_once)
    with Cluster(transport).running() as cluster:
        digest, weights = opened_to_close_itself(cluster)
        cluster.while_busy(lambda: cluster.send(*cluster.updates(digest, weights)))
        told = cluster.reply()
        assert announced(told) == CLIENTS and not getattr(told, "closed", False), "not closed: not said"
        assert failures == [1] and nothing_more(cluster) is None
        assert cluster.aggregator.jobs[cluster.job_id].open_round == 1, "the round stays open"
        cluster.send(RoundClose(job_id=cluster.job_id, round=1, clients=CLIENTS))
        closed = cluster.reply()
        assert isinstance(closed, RoundClosed) and closed.clients == CLIENTS
    assert transport.dead() == []
