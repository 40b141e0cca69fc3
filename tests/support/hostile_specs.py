"""Job specs that name code no allow-list of the tests lets in, in every place a spec names code."""

from __future__ import annotations

from typing import Any

from tests.conftest import small_job

# (where the spec names it, the ref, what is counted)
HOSTILE = [
    ("task", "subprocess:run", "task"),
    ("task", "os:system", "task"),
    ("task", "torch.hub:load", "task"),
    ("task", "this:x", "task"),
    ("task", "tests.support.outsider:Outsider", "task"),
    ("strategy", "os:system", "strategy"),
    ("inner", "subprocess:run", "strategy"),
    ("trainer", "os:system", "trainer"),
]


def hostile_spec(where: str, ref: str) -> dict[str, Any]:
    """A small digits job naming `ref` as its Task, its strategy, clipped's inner or a Mini-Ray trainer."""
    if where == "task":
        spec = small_job(task__name=ref)
    elif where == "strategy":
        spec = small_job(strategy=ref)
    elif where == "inner":
        spec = small_job(strategy={"name": "clipped", "options": {"inner": {"name": ref}}})
    else:
        spec = small_job(task={"name": "fedmq.compat.miniray:WorkerTask", "options": {"trainer": ref}})
    return spec.model_dump(mode="json")
