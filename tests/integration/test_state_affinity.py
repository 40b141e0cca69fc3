"""Clients go back to the learner that keeps their state (services/learner/statecache.py), which
then uses its own copy instead of fetching the aggregator's; the weights are the engine's, bit for bit.

Each round trains all 4 clients on 2 learners, so from round 2 on each learner is sent back at
least its share (2) of the clients it trained: at least 6 of the 12 states in rounds 2-4 come from
a learner's own copy, whichever learner trained which client first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import SecretStr

from fedmq.common.bus import topology
from fedmq.common.checkpoint import load_state
from fedmq.common.messages import JobSubmit, to_wire
from fedmq.services.cli.embedded import EmbeddedCluster, new_job_id
from fedmq.services.cli.follow import JobFollower
from tests.conftest import EmbeddedRuns, assert_bit_identical, small_job
from tests.integration.conftest import Transport

ROUNDS, CLIENTS, LEARNERS = 4, 4, 2


def cache_events(cluster: EmbeddedCluster, event: str) -> int:
    return int(sum(
        learner.metrics.registry.get_sample_value("fedmq_learner_state_cache_total", {"event": event}) or 0
        for learner in cluster.learners
    ))


@pytest.mark.parametrize("key", [None, "the learners' own sealing key"], ids=["clear", "sealed"])
def test_clients_go_back_to_the_learner_keeping_their_state_and_end_bit_identical(
    transport: Transport, tmp_path: Path, embedded_runs: EmbeddedRuns, key: str | None
) -> None:
    spec = small_job(rounds=ROUNDS, clients__total=CLIENTS, clients__per_round=CLIENTS,
                     train__momentum=0.9, train__keep_optimizer_state=True)
    threads = max(1, (os.cpu_count() or 1) // 2)  # as embedded_runs' engine run
    settings = transport.settings.model_copy(update={
        "torch_threads": threads, "state_key": None if key is None else SecretStr(key)})
    job_id = new_job_id(spec)
    with EmbeddedCluster(settings, learners=LEARNERS, connect=transport.connect) as cluster:
        follower = JobFollower(cluster.connect("cli"), job_id).start()
        try:
            follower.bus.publish(topology.SCHEDULER, to_wire(JobSubmit(
                job_id=job_id, spec=spec.model_dump(mode="json"))))
            events = list(follower.events(idle_timeout=120))
        finally:
            follower.close()
        hits, misses = cache_events(cluster, "hit"), cache_events(cluster, "miss")
    assert events[-1].kind == "completed", events[-1].data
    assert hits >= (ROUNDS - 1) * CLIENTS // LEARNERS, (hits, misses)
    assert hits + misses <= (ROUNDS - 1) * CLIENTS, "round 1 has no state to look for"
    weights, _ = load_state(events[-1].data["model_path"])
    assert_bit_identical(weights, embedded_runs.weights(spec))
