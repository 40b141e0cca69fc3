"""The aggregator's group commit: updates that arrive together are stored, announced and acked together.

Each update is checked and written as it comes; once no more have arrived, all of them are made
durable at once, announced in one UpdatesAccepted per round and acked. A store that fails leaves
them unacked and the queue waiting behind them, in order, until the retry goes through.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.bus.memory import MemoryBroker, MemoryBus
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import (
    ClientUpdate,
    JobCreate,
    Message,
    RoundClose,
    RoundClosed,
    RoundOpen,
    UpdateAccepted,
    UpdatesAccepted,
    from_wire,
    to_wire,
)
from fedmq.common.settings import Settings
from fedmq.services.aggregator.service import AggregatorService
from tests.conftest import small_job
from tests.integration.conftest import Transport
from tests.rabbit import close_connections, fresh_vhost

WAIT = 30.0
CLIENTS = [0, 1, 2, 3, 4]


class Cluster:
    """An aggregator on its own bus, and a stand-in scheduler that publishes and records its replies."""

    def __init__(self, transport: Transport, spec: JobSpec | None = None) -> None:
        settings = transport.settings.model_copy(update={"retry_initial_s": 0.05, "state_retry_max_s": 0.2})
        self.spec = spec or small_job()
        self.aggregator = AggregatorService(settings, transport.connect("aggregator"))
        self.scheduler = transport.connect("scheduler")
        self.replies: queue.Queue[Message] = queue.Queue()
        self.job_id = "group-commit"

    def _record(self, delivery: Delivery) -> None:
        self.replies.put(from_wire(delivery.body))
        delivery.ack()

    @contextmanager
    def running(self) -> Iterator[Cluster]:
        self.scheduler.consume(topology.SCHEDULER, self._record)
        buses: list[Bus] = [self.aggregator.bus, self.scheduler]
        threads = [threading.Thread(target=bus.run, daemon=True) for bus in buses]
        self.aggregator.start()
        for thread in threads:
            thread.start()
        try:
            assert all(bus.wait_ready(WAIT) for bus in buses)
            yield self
        finally:
            for bus in buses:
                bus.stop()
            for thread in threads:
                thread.join(WAIT)

    def send(self, *messages: Message) -> None:
        self.scheduler.publish_all([(topology.AGGREGATOR, to_wire(m)) for m in messages])

    def reply(self) -> Message:
        return self.replies.get(timeout=WAIT)

    def open_round_one(self) -> tuple[str, dict[str, torch.Tensor]]:
        """The job created and round 1 open: the global model's digest and weights."""
        self.send(JobCreate(job_id=self.job_id, spec=self.spec.model_dump(mode="json")))
        created = self.reply()
        assert isinstance(created, RoundClosed) and created.round == 0, created
        self.send(RoundOpen(job_id=self.job_id, round=1, clients=CLIENTS))
        return created.model_digest, dict(self.aggregator.jobs[self.job_id].weights)

    def updates(self, digest: str, weights: dict[str, torch.Tensor]) -> list[ClientUpdate]:
        return [ClientUpdate(job_id=self.job_id, task_id=f"t{c}", round=1, client=c, base_digest=digest,
                             num_examples=10, weights={k: v + c for k, v in weights.items()},
                             learner="L1", state_tag=f"tag{c}")
                for c in CLIENTS]

    def while_busy(self, then: Callable[[], None]) -> None:
        """Run `then` while the aggregator's thread is held, then let it go on: what `then` sends
        has all arrived when it looks at its deliveries again."""
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            held.set()
            assert release.wait(WAIT)

        self.aggregator.bus.call_soon(hold)
        assert held.wait(WAIT)
        then()
        time.sleep(0.5)  # long enough for the broker to push them to the aggregator
        release.set()

    def stored(self) -> list[Path]:
        return sorted((self.aggregator.root / self.job_id / "updates" / "r1").glob("c*.msg"))


def announced(message: Message) -> list[int]:
    if isinstance(message, UpdatesAccepted):
        return [u.client for u in message.updates]
    assert isinstance(message, UpdateAccepted), message
    return [message.client]


def test_updates_that_arrive_together_are_stored_then_announced_in_one_message(transport: Transport) -> None:
    with Cluster(transport).running() as cluster:
        digest, weights = cluster.open_round_one()
        updates = cluster.updates(digest, weights)
        cluster.while_busy(lambda: cluster.send(*updates))
        together = cluster.reply()
        assert isinstance(together, UpdatesAccepted), together
        assert announced(together) == CLIENTS
        assert [(u.learner, u.state_tag) for u in together.updates] == [("L1", f"tag{c}") for c in CLIENTS]
        assert [p.name for p in cluster.stored()] == [f"c{c}.msg" for c in CLIENTS]
        # A duplicate (here trained again elsewhere): announced again, stored once, and named as
        # the stored one, whose state is the one kept (learner/statecache.py).
        cluster.send(updates[2].model_copy(update={"learner": "L2", "state_tag": "tagX"}))  # same size
        again = cluster.reply()
        assert announced(again) == [2] and isinstance(again, UpdateAccepted)
        assert (again.learner, again.state_tag) == ("L1", "tag2")
        assert again.bytes == together.updates[2].bytes > 0  # its size, as the first time
        cluster.send(RoundClose(job_id=cluster.job_id, round=1, clients=CLIENTS))
        closed = cluster.reply()
        assert isinstance(closed, RoundClosed) and closed.clients == CLIENTS
    assert transport.dead() == []


def test_a_large_duplicate_is_announced_as_the_stored_update(transport: Transport) -> None:
    """An update over a frame (chunked on RabbitMQ, received into a spool file) takes the other
    path; its duplicate too names the update whose state is kept."""
    spec = small_job(task__options__model__hidden=[512])  # ~150 kB: over the 64 kB test frame
    with Cluster(transport, spec).running() as cluster:
        digest, weights = cluster.open_round_one()
        first = cluster.updates(digest, weights)[0]
        cluster.send(first)
        stored = cluster.reply()
        assert isinstance(stored, UpdateAccepted) and (stored.learner, stored.state_tag) == ("L1", "tag0")
        cluster.send(first.model_copy(update={"learner": "L2", "state_tag": "tagX"}))
        again = cluster.reply()
        assert isinstance(again, UpdateAccepted) and (again.learner, again.state_tag) == ("L1", "tag0")
    assert transport.dead() == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to tell files apart")
def test_a_group_that_cannot_be_stored_waits_with_what_came_after_it_until_it_can(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = Cluster(transport)
    updates_dir = cluster.aggregator.root / cluster.job_id / "updates"
    failures: list[str] = []
    real_replace = os.replace

    def full_disk_once(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if not failures and Path(dst).is_relative_to(updates_dir):
            failures.append(str(dst))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        real_replace(src, dst)

    with cluster.running():
        digest, weights = cluster.open_round_one()
        monkeypatch.setattr(os, "replace", full_disk_once)
        close = RoundClose(job_id=cluster.job_id, round=1, clients=CLIENTS)
        cluster.while_busy(lambda: cluster.send(*cluster.updates(digest, weights), close))
        # The group's store failed: nothing was announced; its updates were handled again after
        # the backoff, then the RoundClose that waited behind them.
        together, closed = cluster.reply(), cluster.reply()
        assert len(failures) == 1
        assert announced(together) == CLIENTS
        assert isinstance(closed, RoundClosed) and closed.clients == CLIENTS, closed
    assert transport.dead() == []
    assert not list(updates_dir.parent.rglob("*.tmp")), "no staged file is left behind"


@contextmanager
def on_rabbitmq(tmp_path: Path) -> Iterator[Transport]:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path / "state", log_format="json",
                            frame_bytes=64 * 1024)
        yield Transport("rabbitmq", settings, lambda name: RabbitBus(settings, name), url=url)


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def replies_until_closed(cluster: Cluster) -> tuple[list[int], RoundClosed]:
    """The clients announced before the round's RoundClosed, and it."""
    clients: list[int] = []
    while not isinstance(reply := cluster.reply(), RoundClosed):
        clients += announced(reply)
    return clients, reply


@pytest.mark.rabbitmq
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to tell files apart")
def test_what_waited_on_a_connection_since_lost_is_handled_once_as_the_broker_gives_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The group and the RoundClose behind it wait for a full disk; the connection drops; the broker
    # gives them all again. Only the new copies may be handled: the old ones closing the round
    # first would make the redelivered updates stale (dead-lettered, counted twice).
    with on_rabbitmq(tmp_path) as transport:
        cluster = Cluster(transport)
        updates_dir = cluster.aggregator.root / cluster.job_id / "updates"
        full, failures = threading.Event(), []
        real_replace = os.replace

        def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            if full.is_set() and Path(dst).is_relative_to(updates_dir):
                failures.append(str(dst))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        with cluster.running():
            digest, weights = cluster.open_round_one()
            full.set()
            close = RoundClose(job_id=cluster.job_id, round=1, clients=CLIENTS)
            cluster.while_busy(lambda: cluster.send(*cluster.updates(digest, weights), close))
            wait_for(lambda: len(failures) >= 2)  # stalled, and its retry failed too
            close_connections(transport.url)
            wait_for(lambda: getattr(cluster.aggregator.bus, "reconnects", 0) > 0)
            time.sleep(0.5)  # the broker gives the deliveries again; they wait behind the stall
            full.clear()
            clients, closed = replies_until_closed(cluster)
            assert closed.clients == CLIENTS and sorted(set(clients)) == CLIENTS
        assert transport.dead() == []


@pytest.mark.rabbitmq
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to tell files apart")
def test_a_large_update_whose_spool_write_failed_keeps_its_place_in_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Updates over the 64 KiB frame come in chunks, received into spool files. The first one's
    # spool write fails once: it is read again after a backoff, and the update and RoundClose
    # after it wait for it, so the round closes with both clients and nothing is dead-lettered.
    with on_rabbitmq(tmp_path) as transport:
        cluster = Cluster(transport, spec=small_job(task__options__model={"name": "mlp", "hidden": [512]}))
        spool = cluster.aggregator.root / "spool"
        failures: list[str] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            if not failures and path.is_relative_to(spool):
                failures.append(str(path))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        with cluster.running():
            digest, weights = cluster.open_round_one()
            first, second = cluster.updates(digest, weights)[:2]
            close = RoundClose(job_id=cluster.job_id, round=1, clients=[0, 1])
            cluster.while_busy(lambda: cluster.send(first, second, close))
            clients, closed = replies_until_closed(cluster)
            assert len(failures) == 1
            assert closed.clients == [0, 1] and sorted(clients) == [0, 1]
        assert transport.dead() == []


def test_a_group_whose_announcement_fails_is_announced_after_a_backoff_in_order(tmp_path: Path) -> None:
    # Stored, then the announcement is refused (once): nothing is dead-lettered or skipped; the
    # group is handled again (as duplicates, announced with their sizes), then the RoundClose.
    broker = MemoryBroker()

    class Refusing(MemoryBus):
        refused = 0

        def publish_all(self, messages: Sequence[tuple[str, bytes]]) -> None:
            if not Refusing.refused and any(b"updates_accepted" in body for _, body in messages):
                Refusing.refused += 1
                raise RuntimeError("refused")
            super().publish_all(messages)

    settings = Settings(state_dir=tmp_path / "state", log_format="json")
    transport = Transport("memory", settings, lambda name: (
        Refusing(broker) if name == "aggregator" else broker.connect()), broker=broker)
    cluster = Cluster(transport)
    with cluster.running():
        digest, weights = cluster.open_round_one()
        close = RoundClose(job_id=cluster.job_id, round=1, clients=CLIENTS)
        cluster.while_busy(lambda: cluster.send(*cluster.updates(digest, weights), close))
        clients, closed = replies_until_closed(cluster)
        assert Refusing.refused == 1
        assert clients == CLIENTS and closed.clients == CLIENTS
    assert transport.dead() == []
