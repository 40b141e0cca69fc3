"""Job specs naming code outside the allow-list, submitted on a real RabbitMQ while a legitimate
job runs: the scheduler refuses each before any service imports it, with a reason naming the
setting and the module, counts it, and the legitimate job ends with the undisturbed weights."""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import urlsplit

import pika
import pytest

from fedmq.common.bus import topology
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.messages import JobEvent, JobSubmit, to_wire
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import EmbeddedRuns, assert_bit_identical, small_job
from tests.rabbit import dead_letters, fresh_vhost
from tests.support.hostile_specs import HOSTILE, hostile_spec


@pytest.mark.rabbitmq
def test_specs_naming_code_outside_the_allow_list_are_refused_and_change_nothing(
    tmp_path: Path, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(rounds=3)
    undisturbed = embedded_runs.weights(spec)
    submitted: list[str] = []
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path, frame_bytes=64 * 1024, allowed_code="")

        def on_event(event: JobEvent) -> None:
            if event.kind == "round_started" and event.round == 1 and not submitted:
                conn = pika.BlockingConnection(pika.URLParameters(url))
                channel = conn.channel()
                for i, (where, ref, _) in enumerate(HOSTILE):
                    submit = JobSubmit(job_id=f"evil-{i}", spec=hostile_spec(where, ref))
                    as_cli = pika.BasicProperties(user_id=urlsplit(url).username)  # a sender it takes
                    channel.basic_publish("", topology.SCHEDULER, to_wire(submit), as_cli)
                    submitted.append(ref.partition(":")[0])
                conn.close()

        result = run_job(spec, settings, connect=lambda name: RabbitBus(settings, name), on_event=on_event,
                         idle_timeout=60)
        dead = dead_letters(url)
    assert result["status"] == "completed"
    assert_bit_identical(load_state(result["model_path"])[0], undisturbed)
    assert result["dead_letters"] == {"code_not_allowed": len(HOSTILE)}  # counted by the scheduler
    reasons = [str(headers.get("x-fedmq-reason", "")) for headers, _ in dead]
    assert len(reasons) == len(HOSTILE)
    for reason in reasons:
        assert reason.startswith("code_not_allowed") and "FEDMQ_ALLOWED_CODE" in reason
    for module in submitted:
        assert any(repr(module) in reason for reason in reasons), module
    assert "this" not in sys.modules and "tests.support.outsider" not in sys.modules
