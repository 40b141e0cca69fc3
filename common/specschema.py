"""The job spec as a JSON Schema, from its pydantic models: what an editor completes and checks
`job.yaml` with (`fedmq schema`; examples/job.schema.json, which a test keeps up to date).

The spec's shorthands read as strings too: `task: digits`, `strategy: fedavg`, `compression: int8`.
A Task's and a strategy's options are their own (checked where they are built): any mapping here.
"""

from __future__ import annotations

import json
from typing import Any

from fedmq.common.jobspec import JobSpec

SHORTHANDS = ("task", "strategy", "compression")  # a string names the section's one key


def job_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a job spec file."""
    schema = JobSpec.model_json_schema(mode="validation")
    for name in SHORTHANDS:
        section = schema["properties"][name]
        described = {k: v for k, v in section.items() if k in ("description", "title")}
        rest = {k: v for k, v in section.items() if k not in ("description", "title", "default")}
        schema["properties"][name] = {**described, "anyOf": [{"type": "string"}, rest]}
    # What the models fill in before they check: a DDP job's clients and rounds (one of each), a
    # site list's total. A federated job names its task (JobSpec._task_given).
    schema["required"] = [k for k in schema["required"] if k not in ("clients", "rounds")]
    schema["if"] = {"not": {"required": ["ddp"]}}
    schema["then"] = {"required": ["task", "clients", "rounds"]}
    clients = schema["$defs"]["ClientsSpec"]
    clients["required"] = [k for k in clients.get("required", []) if k != "total"]
    clients["anyOf"] = [{"required": ["total"]}, {"required": ["sites"]}]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def job_schema_text() -> str:
    return json.dumps(job_schema(), indent=2, sort_keys=True) + "\n"
