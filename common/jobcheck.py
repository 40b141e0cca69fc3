"""A job spec checked against its code before it is published: its Task and strategy built with
their options, the strategy's `check_job` asked, and the Task's default objective filled in.

    fedmq run / submit / fedmq.run ──▶ complete_spec ──▶ task.loading.make_task
                                                     └─▶ strategy.loading.check_strategy
                                        (a DDP job: coderefs.check_code, its entry only)
"""

from __future__ import annotations

from fedmq.common.allowlist import AllowList, active, allowing
from fedmq.common.coderefs import check_code
from fedmq.common.jobspec import JobSpec
from fedmq.common.strategy.loading import check_strategy
from fedmq.common.task.loading import make_task


def complete_spec(spec: JobSpec, allowed: AllowList | None = None) -> JobSpec:
    """Check the spec's Task and strategy can be had with their options, and fill in the Task's
    default objective.

    What the CLI and the Python API do before a job is published: a bad option fails here,
    in the user's terminal, not minutes later in a service.
    """
    if spec.ddp is not None:  # no Task nor strategy: its entry is checked against the allow-list
        check_code(spec, allowed or active())
        return spec
    with allowing(allowed or active()):
        task = make_task(spec.task.name, spec.task.options)
        check_strategy(spec)  # its options, and whether they can work with the rest of the job
    if spec.objective is None and task.objective is not None and spec.measures(task.objective.metric):
        objective = {"metric": task.objective.metric, "mode": task.objective.mode}
        return type(spec).model_validate({**spec.model_dump(mode="json"), "objective": objective})
    return spec
