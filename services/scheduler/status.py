"""Answers to `fedmq status` and `fedmq learners`: the jobs and the fleet as the scheduler sees them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedmq.common.messages import StatusReply, StatusRequest
from fedmq.services.scheduler.jobs import RUNNING, SchedJob
from fedmq.services.scheduler.registry import Registry


def status_reply(
    msg: StatusRequest, jobs: Mapping[str, SchedJob], registry: Registry, now: float
) -> StatusReply:
    """The reply to one status request; `now` is the scheduler's monotonic clock."""
    registry.sweep(now)
    rows = registry.snapshot(now)
    fleet = {
        "alive": sum(r.alive for r in rows),
        "busy": sum(r.busy for r in rows if r.alive),
        "lost": [r.learner for r in rows if not r.alive],
    }
    reply = StatusReply(job_id=msg.job_id, fleet=fleet)
    if msg.what == "learners":
        return reply.model_copy(update={"learners": [i.as_dict(now) for i in rows]})
    if msg.what == "job":
        job = jobs.get(msg.job_id)
        if job is None:
            return reply.model_copy(update={"error": f"no job {msg.job_id!r}"})
        return reply.model_copy(update={"jobs": [job_summary(job, now, history=True)]})
    return reply.model_copy(update={"jobs": [job_summary(j, now, history=False) for j in jobs.values()]})


def job_summary(job: SchedJob, now: float, history: bool) -> dict[str, Any]:
    """One job's row: status, round, last metrics, the open round's bookkeeping (`history`: rounds, spec)."""
    last = job.history[-1] if job.history else {}
    summary: dict[str, Any] = {
        "job_id": job.job_id,
        "name": job.spec.name,
        "status": job.status,
        "round": job.round,
        "rounds": job.spec.rounds,
        "metrics": last.get("metrics", {}),
        "objective": None if job.spec.objective is None else job.spec.objective.model_dump(),
        "best": job.best,
        "reason": job.reason,
        "error": job.error,
        "model_path": last.get("model_path"),
        "wall_seconds": None if job.wall_seconds is None else round(job.wall_seconds, 3),
    }
    if job.group is not None and job.group.get("reports"):  # a DDP job: rank 0's latest report
        summary["report"] = job.group["reports"][-1]
        if not last:
            summary["metrics"] = {"train": summary["report"]["metrics"]}
    if job.group is not None:
        summary["ddp"] = ddp_summary(job)
    if job.state is not None and job.status == RUNNING:
        summary["reported"] = len(job.state.reported)
        summary["sampled"] = len(job.state.clients)
        summary["failed_clients"] = len(job.state.failed)
        summary["retries_left"] = job.state.retries_left
        summary["deadline_in_s"] = round(job.state.deadline - now, 1)
    if history:
        summary["history"] = job.history
        summary["spec"] = job.raw_spec  # what `fedmq model` writes into a downloaded model file
    return summary


def ddp_summary(job: SchedJob) -> dict[str, Any]:
    """A DDP job's group: its members by rank, where rank 0 listens, the backend, the restarts."""
    spec, group = job.spec.ddp, job.group
    assert spec is not None and group is not None
    members = sorted(({"learner": name, "rank": m["rank"], "node": m["node"],
                       "exit": group["exits"].get(str(m["rank"]))} for name, m in group["members"].items()),
                     key=lambda m: m["rank"])
    return {
        "attempt": group["attempt"], "members": members, "world_size": spec.world_size,
        "master_addr": group.get("master_addr") or spec.master_addr, "master_port": spec.master_port,
        "backend": group.get("backend") or spec.backend, "nodes": list(spec.nodes),
        "restarts_used": spec.max_restarts - group["restarts_left"], "max_restarts": spec.max_restarts,
        "step": group.get("step", 0),
    }
