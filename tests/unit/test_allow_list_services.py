"""Each service applies the allow-list itself: the scheduler refuses a job before it starts, and
the aggregator and learners refuse one that reached them some other way (a JobCreate or a task
that bypassed the scheduler). Nothing named is imported; each refusal is counted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import pytest

from fedmq.common.allowlist import CodeNotAllowed
from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.errors import ValidationError
from fedmq.common.messages import JobCreate, JobEvent, JobFailed, JobSubmit, Message, TrainTask, from_wire
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.services.aggregator.service import AggregatorService
from fedmq.services.learner.work import Work
from fedmq.services.scheduler.service import SchedulerService
from tests.conftest import small_job
from tests.support.hostile_specs import HOSTILE, hostile_spec


class Recording:
    """A bus that keeps what a service publishes."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    def publish(self, queue: str, body: bytes, **kwargs: Any) -> None:
        self.sent.append((queue, from_wire(body)))

    def publish_all(self, messages: list[tuple[str, bytes]]) -> None:
        for queue, body in messages:
            self.publish(queue, body)

    def publish_event(self, topic: str, body: bytes) -> None:
        self.sent.append((topic, from_wire(body)))

    def call_later(self, delay: float, callback: Any) -> None:
        """Timers never fire here."""


def refused(metrics: Metrics, what: str) -> float:
    value = metrics.registry.get_sample_value("fedmq_code_refused_total", {"what": what})
    return value or 0.0


@pytest.fixture
def default_list(tmp_path: Path) -> Settings:
    """Settings with FEDMQ_ALLOWED_CODE at its default: fedmq's built-ins only."""
    return Settings(state_dir=tmp_path, allowed_code="")


@pytest.fixture(autouse=True)
def nothing_hostile_is_imported() -> Any:
    yield
    assert "this" not in sys.modules and "tests.support.outsider" not in sys.modules


@pytest.mark.parametrize(("where", "ref", "what"), HOSTILE)
def test_the_scheduler_refuses_the_job_before_it_starts_naming_the_setting(
    default_list: Settings, where: str, ref: str, what: str
) -> None:
    bus = Recording()
    scheduler = SchedulerService(default_list, cast(Bus, bus))
    with pytest.raises(ValidationError) as rejected:
        scheduler.submit(JobSubmit(job_id="evil", spec=hostile_spec(where, ref)))
    assert rejected.value.reason == "code_not_allowed"
    assert "evil" not in scheduler.jobs
    [(_, event)] = bus.sent  # no JobCreate reached the aggregator: only the job's failure
    assert isinstance(event, JobEvent) and event.kind == "failed"
    reason = event.data["reason"]
    assert "FEDMQ_ALLOWED_CODE" in reason and repr(ref.partition(":")[0]) in reason
    assert refused(scheduler.metrics, what) == 1


@pytest.mark.parametrize(("where", "ref", "what"), HOSTILE)
def test_the_aggregator_refuses_a_job_create_that_bypassed_the_scheduler(
    default_list: Settings, where: str, ref: str, what: str
) -> None:
    bus = Recording()
    aggregator = AggregatorService(default_list, cast(Bus, bus))
    aggregator.create_job(JobCreate(job_id="evil", spec=hostile_spec(where, ref)))
    assert "evil" not in aggregator.jobs
    [(queue, failed)] = bus.sent
    assert queue == topology.SCHEDULER and isinstance(failed, JobFailed)
    assert "FEDMQ_ALLOWED_CODE" in failed.reason and repr(ref.partition(":")[0]) in failed.reason
    assert refused(aggregator.metrics, what) == 1
    assert not (default_list.state_dir / "aggregator" / "evil").exists()


@pytest.mark.parametrize(("where", "ref", "what"), HOSTILE)
def test_a_learner_refuses_a_task_that_bypassed_the_scheduler(
    default_list: Settings, where: str, ref: str, what: str
) -> None:
    def fetch(job_id: str, digest: str, downlink: str) -> Any:
        raise AssertionError("a refused task fetches no model")

    metrics = Metrics()
    work = Work(default_list, "learner-0", fetch, metrics)
    task = TrainTask(job_id="evil", task_id="t", round=1, client=0, model_digest="d",
                     spec=hostile_spec(where, ref))
    with pytest.raises(CodeNotAllowed, match="FEDMQ_ALLOWED_CODE"):
        work.train(task)
    assert refused(metrics, what) == 1


def test_services_allow_what_the_setting_names(tmp_path: Path) -> None:
    spec = small_job(task__name="tests.support.outsider:Outsider").model_dump(mode="json")
    bus = Recording()
    settings = Settings(state_dir=tmp_path, allowed_code="tests.support")
    scheduler = SchedulerService(settings, cast(Bus, bus))
    scheduler.submit(JobSubmit(job_id="fine", spec=spec))
    assert [type(m).__name__ for _, m in bus.sent][:1] == ["JobCreate"]  # imported nothing either
    assert "tests.support.outsider" not in sys.modules
    assert refused(scheduler.metrics, "task") == 0
