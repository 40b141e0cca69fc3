"""A job to its end in this process, with the in-process engine: what `fedmq run` and `fedmq.run()` call.

Gives the dict the services' run gives (services/cli/embedded.run_job): status, history, summary
and counters, so that every caller and printer takes either. A DDP job has no rounds for the
engine to run: it goes to the services on the in-memory bus.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from fedmq.common.allowlist import AllowList
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import JobEvent
from fedmq.common.settings import Settings
from fedmq.services.cli.summary import summarize
from fedmq.services.engine.engine import Engine


def run_job(
    spec: JobSpec,
    settings: Settings,
    *,
    job_id: str | None = None,
    resume: bool = False,
    on_event: Callable[[JobEvent], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    on_engine: Callable[[Engine], None] | None = None,
    allowed: AllowList | None = None,
) -> dict[str, Any]:
    """Train `spec` to its end here; `resume`: job `job_id` from its last checkpoint in the state dir.

    `on_engine` is handed the engine before it starts (a Ctrl-C handler calls its `interrupt()`:
    the round in progress ends, is checkpointed, and the result's status is "stopped").
    """
    from fedmq.services.cli.embedded import new_job_id

    if resume and job_id is None:
        raise ValueError("resuming needs the job id")
    if spec.ddp is not None:
        from fedmq.services.cli.embedded import run_job as on_services

        return on_services(spec, settings, job_id=job_id, resume=resume, on_event=on_event, allowed=allowed)
    job_id = job_id or new_job_id(spec)
    if "fsync" not in settings.model_fields_set:
        # Checkpoints are written whole (atomic renames) and a crash resumes from the last whole one:
        # an fsync per file would only slow every checkpoint down.
        settings = settings.model_copy(update={"fsync": False})
    # As a deployed learner trains: one torch thread unless FEDMQ_TORCH_THREADS says otherwise (the
    # same arithmetic, so the same bits on CPU), and the caller's own count given back afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.torch_threads or 1)
    try:
        return _run(spec, settings, job_id, resume, on_event, on_notice, on_engine, allowed)
    finally:
        torch.set_num_threads(threads)


def _run(
    spec: JobSpec, settings: Settings, job_id: str, resume: bool, on_event: Callable[[JobEvent], None] | None,
    on_notice: Callable[[str], None] | None, on_engine: Callable[[Engine], None] | None,
    allowed: AllowList | None,
) -> dict[str, Any]:
    engine = Engine(spec, settings, job_id, allowed=allowed or AllowList.services(settings.allowed_prefixes),
                    on_event=on_event, on_notice=on_notice)
    if on_engine is not None:
        on_engine(engine)
    started = time.perf_counter()
    final = engine.run(resume=resume)
    history = engine.progress.history
    return {
        "model_fetches": [],
        "tasks_redelivered": 0,
        "fused_groups": list(engine.work.fused_groups),
        "reconnects": 0,
        "dead_letters": {},
        "updates_rejected": dict(engine.rejected),
        "jobs_refused": {},
        "engine": "in-process",
        "job_id": job_id,
        "name": spec.name,
        "ddp": False,
        "wall_seconds": time.perf_counter() - started,
        **final,
        **summarize(history, None if spec.objective is None else spec.objective.model_dump()),
        "history": history,
    }
