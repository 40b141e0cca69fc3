"""The job spec's JSON Schema: generated from the models, kept in examples/, and true to them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import parse_job
from fedmq.common.specschema import job_schema, job_schema_text
from fedmq.services.cli.main import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCHEMA = EXAMPLES / "job.schema.json"


def test_the_schema_in_examples_is_the_one_the_models_give() -> None:
    assert SCHEMA.read_text() == job_schema_text(), "run `fedmq schema --out examples/job.schema.json`"
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0 and json.loads(result.output) == job_schema()


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_points_an_editor_at_the_schema_and_passes_it(example: Path) -> None:
    text = example.read_text()
    assert text.splitlines()[0] == "# yaml-language-server: $schema=job.schema.json"
    jsonschema.validate(yaml.safe_load(text), job_schema())


@pytest.mark.parametrize("raw", [
    {"name": "j", "task": "digits", "clients": {"total": 2}, "rouds": 1},  # a typo
    {"name": "j", "clients": {"total": 2}, "rounds": 1},  # no task
    {"name": "j", "task": "digits", "clients": {"per_round": 2}, "rounds": 1},  # neither total nor sites
    {"name": "j", "task": "digits", "clients": {"total": 2}, "rounds": 1, "train": {"lr": -1}},
])
def test_what_the_schema_refuses_the_models_refuse_too(raw: dict) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, job_schema())
    with pytest.raises(ConfigError):
        parse_job(raw)
