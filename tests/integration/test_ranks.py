"""Seed 003's two rank tables, from real learners registering with a real scheduler, on both buses.

ProcGuard's rules: the master node first, the other nodes by name, workers by numeric id within
a node, local ranks from 0 on each node. The learners here are LearnerService instances whose
heartbeats carry their node and replica; `fedmq learners` reads the ranks from the scheduler.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.messages import StatusReply, StatusRequest, expect, from_wire, to_wire
from fedmq.services.learner.service import LearnerService
from fedmq.services.scheduler.service import SchedulerService
from tests.integration.conftest import Transport

# (node, worker id) → (RANK, LOCAL_RANK, NODE_RANK), as seed 003's tables give them, master gn6.
FOUR_NODES = {("gn6", 0): (0, 0, 0), ("gn39", 0): (1, 0, 1), ("gn40", 0): (2, 0, 2), ("gn7", 0): (3, 0, 3)}
TWO_NODES = {("gn6", 0): (0, 0, 0), ("gn6", 1): (1, 1, 0), ("gn7", 0): (2, 0, 1), ("gn7", 1): (3, 1, 1)}


@contextmanager
def fleet(transport: Transport, workers: list[tuple[str, int]]) -> Iterator[Bus]:
    """A scheduler (master node gn6) and one learner per (node, worker id); a client bus to ask."""
    settings = transport.settings.model_copy(update={"master_node": "gn6", "liveness_s": 0.2})
    services: list[SchedulerService | LearnerService] = [
        SchedulerService(settings, transport.connect("scheduler")),
        *[LearnerService(settings.model_copy(update={"node": node, "replica": worker}),
                         transport.connect(f"learner-{node}-{worker}")) for node, worker in workers],
    ]
    client = transport.connect("cli")
    threads = [threading.Thread(target=bus.run, daemon=True)
               for bus in [client, *(service.bus for service in services)]]
    try:
        for service in services:
            service.start()
        for thread in threads:
            thread.start()
        client.wait_ready(30)
        yield client
    finally:
        for service in services:
            if isinstance(service, LearnerService):
                service.shutdown()
        for bus in [client, *(service.bus for service in services)]:
            bus.stop()
        for thread in threads:
            thread.join(10)


def learners(client: Bus, count: int) -> list[dict[str, Any]]:
    """`fedmq learners`' rows once `count` learners are alive."""
    deadline = time.monotonic() + 30
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        body = client.request(topology.SCHEDULER, to_wire(StatusRequest(what="learners")), timeout=10)
        rows = [row for row in expect(from_wire(body), StatusReply).learners if row["alive"]]
        if len(rows) == count:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"{len(rows)} of {count} learners registered: {rows}")


@pytest.mark.parametrize("table", [FOUR_NODES, TWO_NODES], ids=["4-nodes", "2-nodes-2-workers"])
def test_real_registrations_get_seed_003s_ranks(transport: Transport, table: dict) -> None:
    with fleet(transport, list(table)) as client:
        rows = learners(client, len(table))
    got = {(row["node"], row["replica"]): (row["rank"], row["local_rank"], row["node_rank"]) for row in rows}
    assert got == table
    assert {row["world_size"] for row in rows} == {len(table)}
    assert [row["learner"] for row in rows] == [f"{node}/{worker}" for node, worker in table]  # rank order
