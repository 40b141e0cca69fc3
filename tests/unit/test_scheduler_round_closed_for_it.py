"""The scheduler and a round its aggregator closes itself (RoundOpen.close_when_complete).

Told with the last updates that the round is closed (UpdatesAccepted.closed), it sends no
RoundClose and waits for the RoundClosed that follows. A RoundClosed it did not ask for is taken
only when it folds every sampled client: the close it would have asked for (the announcement that
said so was lost); any other is not its to take.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.messages import (
    RoundClose,
    RoundClosed,
    RoundOpen,
    UpdateAccepted,
    UpdatesAccepted,
    to_wire,
)
from fedmq.common.settings import Settings
from fedmq.services.scheduler.jobs import SchedJob
from fedmq.services.scheduler.service import SchedulerService
from tests.conftest import small_job
from tests.unit.test_scheduler_evaluation_timers import Clocked


def in_round_one(tmp_path: Path) -> tuple[SchedulerService, Clocked, SchedJob]:
    """A job whose round 1 is open, its tasks sent: 3 of 4 clients sampled, a quorum of 2."""
    bus = Clocked()
    service = SchedulerService(Settings(state_dir=tmp_path), cast(Bus, bus))
    service.rows.open()
    spec = small_job(clients__total=4, clients__per_round=3, clients__min_fit=2)
    job = SchedJob("j", spec, spec.model_dump(mode="json"), round=0, model_digest="d0")
    service.jobs[job.job_id] = job
    service.rounds.start_round(job, 1)
    return service, bus, job


def updates(job: SchedJob, clients: list[int], closed: bool = False) -> UpdatesAccepted:
    return UpdatesAccepted(job_id=job.job_id, round=1, closed=closed, updates=[
        UpdateAccepted(job_id=job.job_id, round=1, client=c, num_examples=10) for c in clients])


def round_closed(job: SchedJob, clients: list[int]) -> RoundClosed:
    return RoundClosed(job_id=job.job_id, round=1, model_digest="d1", clients=clients, num_examples=30)


def to_aggregator(bus: Clocked) -> list[object]:
    return [msg for queue, msg in bus.sent if queue == topology.AGGREGATOR]


def test_the_round_opens_letting_the_aggregator_close_it(tmp_path: Path) -> None:
    _, bus, job = in_round_one(tmp_path)
    opened = to_aggregator(bus)
    assert len(opened) == 1 and isinstance(opened[0], RoundOpen)
    assert opened[0].close_when_complete and opened[0].clients == job.state.clients  # type: ignore[union-attr]


def test_told_the_round_is_closed_it_sends_no_round_close(tmp_path: Path) -> None:
    service, bus, job = in_round_one(tmp_path)
    assert job.state is not None
    bus.sent.clear()
    service._handle(updates(job, job.state.clients, closed=True))
    assert job.state.closing and not to_aggregator(bus)
    assert not bus.armed(), "the round's deadline and nudge are off"
    service._handle(round_closed(job, job.state.clients))
    opened = to_aggregator(bus)
    assert job.round == 2 and job.history[-1]["round"] == 1 and job.model_digest == "d1"
    assert len(opened) == 1 and isinstance(opened[0], RoundOpen) and opened[0].round == 2


def test_not_told_it_asks_for_the_close_itself(tmp_path: Path) -> None:
    service, bus, job = in_round_one(tmp_path)
    assert job.state is not None
    bus.sent.clear()
    service._handle(updates(job, job.state.clients))
    closes = to_aggregator(bus)
    assert len(closes) == 1 and isinstance(closes[0], RoundClose) and closes[0].clients == job.state.clients


def test_a_round_closed_with_every_client_is_taken_unasked(tmp_path: Path) -> None:
    service, bus, job = in_round_one(tmp_path)
    assert job.state is not None
    service._handle(updates(job, job.state.clients[:1]))  # the rest's announcement was lost
    service._handle(round_closed(job, job.state.clients))
    assert job.round == 2 and job.history[-1]["round"] == 1
    record = job.history[-1]
    assert (record["clients"], record["failed"], "failures" in record) == (3, 0, False), \
        "the record names what was folded, not what was heard"


def test_a_deadline_close_that_met_a_close_of_every_client_records_every_client(tmp_path: Path) -> None:
    service, bus, job = in_round_one(tmp_path)
    assert job.state is not None
    service._handle(updates(job, job.state.clients[:2]))
    job.state.deadline = 0.0  # passed, with a quorum: the scheduler closes without the third
    service.rounds.advance(job)
    close = to_aggregator(bus)[-1]
    assert isinstance(close, RoundClose) and len(close.clients) == 2
    service._handle(round_closed(job, job.state.clients))  # the aggregator had closed it with all three
    record = job.history[-1]
    assert (record["clients"], record["failed"]) == (3, 0)


def test_with_the_setting_off_the_scheduler_closes_every_round(tmp_path: Path) -> None:
    bus = Clocked()
    service = SchedulerService(Settings(state_dir=tmp_path, aggregator_closes_rounds=False), cast(Bus, bus))
    service.rows.open()
    spec = small_job()
    job = SchedJob("j", spec, spec.model_dump(mode="json"), round=0, model_digest="d0",
                   best={"round": 0, "value": 1.0, "model_digest": "kept"})
    service.jobs[job.job_id] = job
    service.rounds.start_round(job, 1)
    opened = to_aggregator(bus)[0]
    assert isinstance(opened, RoundOpen) and not opened.close_when_complete and opened.keep == []
    assert b"close_when_complete" not in to_wire(opened) and b"keep" not in to_wire(opened), \
        "an aggregator from before these fields reads it"


def test_a_round_closed_without_every_client_is_not_taken_unasked(tmp_path: Path) -> None:
    service, _, job = in_round_one(tmp_path)
    assert job.state is not None
    service._handle(round_closed(job, job.state.clients[:2]))
    assert job.round == 1 and not job.history and not job.state.closing
