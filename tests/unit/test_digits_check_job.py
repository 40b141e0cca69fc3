"""The built-in digits Task refuses, before the job runs, a job its partition cannot split."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedmq.common.allowlist import AllowList
from fedmq.common.jobspec import load_job
from fedmq.services.cli.app import check_task
from fedmq.services.cli.main import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(("clients", "partition", "message"), [
    (1439, "{kind: iid}",
     "clients.total (1439) exceeds the 1438 training samples; lower clients.total to at most 1438"),
    (720, "{kind: shards, shards_per_client: 2}",
     "shards partition needs clients.total x shards_per_client = 1440 shards"),
])
@pytest.mark.parametrize("command", ["run", "submit"])
def test_more_clients_than_the_digits_can_feed_is_refused_before_publishing(
    tmp_path: Path, command: str, clients: int, partition: str, message: str
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"name: many\nrounds: 1\nclients: {{total: {clients}}}\n"
                   f"task: {{name: digits, options: {{partition: {partition}}}}}\n")
    result = CliRunner().invoke(app, [command, str(job)])  # submit: refused before any broker
    assert result.exit_code == 2, result.output
    assert f"error: task 'digits' cannot run this job: {message}" in result.output


def test_the_digits_examples_pass_the_check() -> None:
    for name in ("digits.yaml", "digits-100.yaml", "digits-shards.yaml"):
        check_task(load_job(EXAMPLES / name), AllowList.services(()))
