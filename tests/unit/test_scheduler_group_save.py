"""The scheduler's group save: the jobs its messages changed are saved once, then those messages acked."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from fedmq.common.bus.base import Delivery
from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.errors import StateUnwritable
from fedmq.common.settings import Settings
from fedmq.services.scheduler.jobs import SchedJob
from fedmq.services.scheduler.service import SchedulerService

FULL = StateUnwritable("jobs.sqlite", 28, "database or disk is full")


@dataclass(eq=False)
class Recorded(Delivery):
    settled: list[str] = field(default_factory=list)

    def ack(self) -> None:
        self.settled.append("ack")

    def reject(self, reason: str) -> None:
        self.settled.append("reject")

    def requeue(self) -> None:
        self.settled.append("requeue")


def scheduler(tmp_path: Path, fails: dict[str, Exception]) -> tuple[SchedulerService, list[str]]:
    service = SchedulerService(Settings(state_dir=tmp_path, retry_initial_s=60), MemoryBroker().connect())
    saved: list[str] = []

    def save(job: SchedJob) -> None:
        if job.job_id in fails:
            raise fails[job.job_id]
        saved.append(job.job_id)

    service.rows.save = save  # type: ignore[method-assign]
    return service, saved


def changed(service: SchedulerService, *job_ids: str) -> list[Recorded]:
    deliveries = []
    for job_id in job_ids:
        job = cast(SchedJob, type("Job", (), {"job_id": job_id})())
        deliveries.append(Recorded(body=b"", queue="fedmq.scheduler"))
        service.saves.add(deliveries[-1], job)
    return deliveries


def test_a_job_whose_save_crashes_does_not_hold_back_the_others(tmp_path: Path) -> None:
    service, saved = scheduler(tmp_path, {"a": TypeError("not JSON serializable")})
    deliveries = changed(service, "a", "b", "b")
    assert service.saves.flush()
    assert saved == ["b"]  # once for both its messages
    assert [d.settled for d in deliveries] == [["ack"], ["ack"], ["ack"]]
    assert not service.saves


def test_a_full_disk_keeps_every_message_unacked_for_the_retry(tmp_path: Path) -> None:
    service, saved = scheduler(tmp_path, {"b": FULL})
    deliveries = changed(service, "a", "b")
    assert not service.saves.flush()
    assert saved == ["a"]  # a is on disk; b waits for the retry, and both messages with it
    assert [d.settled for d in deliveries] == [[], []]
    assert service.saves


def test_the_retry_saves_what_is_left_and_acks_them_all(tmp_path: Path) -> None:
    fails: dict[str, Exception] = {"b": FULL}
    service, saved = scheduler(tmp_path, fails)
    deliveries = changed(service, "a", "b")
    service.saves.flush()
    fails.clear()
    later = changed(service, "c")  # handled while the retry waits: saved and acked with them
    assert service.saves.flush()  # what the retry timer runs
    assert saved == ["a", "a", "b", "c"]  # a again: a save is idempotent
    assert [d.settled for d in deliveries + later] == [["ack"], ["ack"], ["ack"]]
    assert not service.saves
