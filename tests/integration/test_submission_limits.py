"""The scheduler refuses a submission past a limit: the spec's own size (a bomb, deep nesting, a
huge options blob, a huge message) or the deployment's (clients, rounds, jobs at once). Each is
refused with its message and counted by limit; on both buses."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.messages import (
    JobCancel,
    JobCreate,
    JobEvent,
    JobFailed,
    JobSubmit,
    expect,
    from_wire,
    to_wire,
)
from fedmq.common.settings import Settings
from fedmq.common.speclimits import MAX_DEPTH, MAX_NODES, MAX_OPTIONS_BYTES, SCALAR_BYTES
from fedmq.services.aggregator.service import AggregatorService
from fedmq.services.scheduler.service import SchedulerService
from tests.conftest import small_job
from tests.integration.conftest import Transport

HANG = 30.0


def raw_spec(**changes: Any) -> dict[str, Any]:
    raw = small_job().model_dump(mode="json")
    raw.update(changes)
    return raw


def nested(depth: int) -> dict[str, Any]:
    root: dict[str, Any] = {}
    node = root
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return root


assert 9000 * SCALAR_BYTES > MAX_OPTIONS_BYTES

SPEC_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    # id: (raw spec, limit, a piece of the message)
    "many-values": (raw_spec(task={"name": "digits", "options": {"v": [0] * (MAX_NODES + 1)}}),
                    "spec_nodes", f"more than {MAX_NODES} values"),
    "deep": (raw_spec(train={"options": nested(MAX_DEPTH + 5)}), "spec_depth", f"{MAX_DEPTH} levels deep"),
    # Small on the wire (a message over the scheduler's frame is refused before it is read), large
    # as options: every number counts SCALAR_BYTES.
    "options-blob": (raw_spec(strategy={"name": "fedavg", "options": {"x": [0] * 9000}}),
                     "options_bytes", f"strategy.options: more than {MAX_OPTIONS_BYTES} bytes"),
    "clients": (raw_spec(clients={"total": 50}), "max_clients", "FEDMQ_MAX_CLIENTS"),
    "rounds": (raw_spec(rounds=30), "max_rounds", "FEDMQ_MAX_ROUNDS"),
}


@contextmanager
def scheduler(
    transport: Transport, **settings: Any
) -> Iterator[tuple[SchedulerService, Bus, list[JobEvent]]]:
    """A scheduler with no aggregator (jobs it accepts stay running), and a bus that hears every event."""
    merged = Settings(**{**transport.settings.model_dump(), **settings})
    service = SchedulerService(merged, transport.connect("scheduler"))
    watcher = transport.connect("watcher")
    events: list[JobEvent] = []
    watcher.subscribe(topology.job_topic("*"), lambda body: events.append(expect(from_wire(body), JobEvent)))
    threads = [threading.Thread(target=bus.run, daemon=True) for bus in (service.bus, watcher)]
    service.start()
    for thread in threads:
        thread.start()
    try:
        assert watcher.wait_ready(HANG) and service.bus.wait_ready(HANG)
        yield service, watcher, events
    finally:
        for bus in (service.bus, watcher):
            bus.stop()
        for thread in threads:
            thread.join(HANG)


def wait_for(events: list[JobEvent], job_id: str, kind: str) -> JobEvent:
    done = threading.Event()
    for _ in range(int(HANG / 0.05)):
        found = [e for e in events if e.job_id == job_id and e.kind == kind]
        if found:
            return found[0]
        done.wait(0.05)
    raise AssertionError(f"no {kind} event for {job_id}: {[(e.job_id, e.kind) for e in events]}")


def refused(service: SchedulerService) -> dict[str, float]:
    return {s.labels["limit"]: s.value for family in service.metrics.jobs_refused.collect()
            for s in family.samples if s.name.endswith("_total") and s.value}


def test_each_oversized_or_over_limit_submission_is_refused_with_its_message_and_counted(
    transport: Transport,
) -> None:
    with scheduler(transport, max_clients=10, max_rounds=20) as (service, watcher, events):
        for case, (spec, _, _) in SPEC_CASES.items():
            watcher.publish(topology.SCHEDULER, to_wire(JobSubmit(job_id=case, spec=spec)))
        watcher.publish(topology.SCHEDULER, to_wire(JobSubmit(job_id="fine", spec=raw_spec())))
        for case, (_, limit, message) in SPEC_CASES.items():
            event = wait_for(events, case, "failed")
            assert message in event.data["reason"], case
            assert event.data["limit"] == limit
        wait_for(events, "fine", "accepted")
        assert refused(service) == {limit: 1.0 for _, limit, _ in SPEC_CASES.values()}
        assert set(service.jobs) == {"fine"}
    reasons = [reason.split(":", 1)[0] for reason, _ in transport.dead()]
    assert reasons == ["over_limit"] * len(SPEC_CASES)


def test_a_submission_beyond_the_jobs_running_at_once_is_refused_until_one_ends(transport: Transport) -> None:
    with scheduler(transport, max_jobs=2) as (service, watcher, events):
        for job_id in ("one", "two", "three"):
            watcher.publish(topology.SCHEDULER, to_wire(JobSubmit(job_id=job_id, spec=raw_spec())))
            wait_for(events, job_id, "accepted" if job_id != "three" else "failed")
        assert "FEDMQ_MAX_JOBS=2" in wait_for(events, "three", "failed").data["reason"]
        watcher.publish(topology.SCHEDULER, to_wire(JobSubmit(job_id="four", spec=raw_spec())))
        wait_for(events, "four", "failed")
        # "one" ends: a new submission fits again.
        watcher.publish(topology.SCHEDULER, to_wire(JobCancel(job_id="one")))
        wait_for(events, "one", "cancelled")
        watcher.publish(topology.SCHEDULER, to_wire(JobSubmit(job_id="five", spec=raw_spec())))
        wait_for(events, "five", "accepted")
        assert refused(service) == {"max_jobs": 2.0}
        assert sorted(service.jobs) == ["five", "one", "two"]


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 500])
def test_a_deeply_nested_submission_never_reaches_the_spec_model(transport: Transport, depth: int) -> None:
    with scheduler(transport) as (service, watcher, events):
        spec = raw_spec(task={"name": "digits", "options": nested(depth)})
        watcher.publish(topology.SCHEDULER, to_wire(JobSubmit(job_id="deep", spec=spec)))
        assert "levels deep" in wait_for(events, "deep", "failed").data["reason"]
        assert refused(service) == {"spec_depth": 1.0}


def test_a_job_create_past_a_spec_limit_fails_at_the_aggregator_too(transport: Transport) -> None:
    # Defence in depth: a JobCreate that never went through the scheduler's check.
    aggregator = AggregatorService(transport.settings, transport.connect("aggregator"))
    watcher = transport.connect("watcher")
    replies: list[JobFailed] = []
    done = threading.Event()

    def on_reply(delivery: Delivery) -> None:
        replies.append(expect(from_wire(delivery.body), JobFailed))
        delivery.ack()
        done.set()

    watcher.consume(topology.SCHEDULER, on_reply)
    threads = [threading.Thread(target=bus.run, daemon=True) for bus in (aggregator.bus, watcher)]
    aggregator.start()
    for thread in threads:
        thread.start()
    try:
        assert watcher.wait_ready(HANG) and aggregator.bus.wait_ready(HANG)
        spec = raw_spec(task={"name": "digits", "options": nested(MAX_DEPTH + 1)})
        watcher.publish(topology.AGGREGATOR, to_wire(JobCreate(job_id="deep", spec=spec)))
        assert done.wait(HANG)
    finally:
        for bus in (aggregator.bus, watcher):
            bus.stop()
        for thread in threads:
            thread.join(HANG)
    assert "levels deep" in replies[0].reason and replies[0].job_id == "deep"
    assert aggregator.metrics.refused_counts() == {"spec_depth": 1.0}
    assert "deep" not in aggregator.jobs
