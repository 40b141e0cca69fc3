"""DDP jobs (seed 003): pick a group of learners, rank them, launch, watch, restart or finish.

    accepted ─▶ (enough idle learners) ─▶ DdpLaunch × world_size ─▶ each learner's own queue
       ▲                                        │
       │        DdpExit(code ≠ 0), or a member's learner lost ─▶ DdpStop to the rest
       └──────── restarts left: attempt + 1, from the last checkpoint ◀──┘   none left: failed
    DdpStored(checkpoint) ─▶ the restart point    every rank exited 0 + DdpStored(final) ─▶ completed
    DdpProgress ─▶ event `progress` (watch shows the lines and rank 0's reports), the job's row
                   (its latest report; every report in the final record), Prometheus

The group is chosen among alive learners in no group and not busy (on `ddp.nodes` if named)
in seed 003's order, so the ranks are that order's: the master node first, the other nodes by
name, workers by replica. The job's state (group, attempt, exits, checkpoint) lives in its
row, so a restarted scheduler goes on with it; a group whose members it does not hear from
within their liveness is torn down and started again like any failed one.

SchedulerService holds one DdpLoop on the shared SchedContext: the sweep calls `tick`, the
service's handler `exited`, `progress` and `stored`; a job ends, is saved and is announced
through the context (finish, save, event).
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from fedmq.common.bus import topology
from fedmq.common.messages import DdpExit, DdpLaunch, DdpProgress, DdpStop, DdpStored, to_wire
from fedmq.services.scheduler.context import SchedContext
from fedmq.services.scheduler.jobs import COMPLETED, FAILED, RUNNING, SchedJob
from fedmq.services.scheduler.registry import LearnerInfo, assign_ranks

log = structlog.get_logger("fedmq.scheduler")

KEPT_REPORTS = 10_000  # of one attempt, in the job's row; older ones are dropped first


def new_group(job: SchedJob) -> dict[str, Any]:
    assert job.spec.ddp is not None
    return {"attempt": 0, "members": {}, "exits": {}, "restarts_left": job.spec.ddp.max_restarts,
            "checkpoint": "", "step": 0, "final": None, "started": 0.0, "reports": []}


class DdpLoop:
    """DDP groups: formed from the registry's learners, watched, restarted or ended through the context."""

    def __init__(self, ctx: SchedContext) -> None:
        self.ctx = ctx

    # -- forming and launching ---------------------------------------------------------------

    def tick(self) -> None:
        """Each sweep: launch groups that wait for learners, tear down those that lost one.

        Not while the scheduler has just started: it has not heard its learners yet, and a group
        that runs on must not be taken for lost (nor a new one formed on too few learners)."""
        if self.ctx.hearing_learners():
            return
        alive = {info.learner for info in self.ctx.registry.alive()}
        for job in list(self.ctx.jobs.values()):
            if job.status != RUNNING or job.group is None:
                continue
            group = job.group
            if not group["members"]:
                if self._launch(job):
                    self.ctx.save(job)
                continue
            lost = sorted(name for name in group["members"] if name not in alive)
            if lost:
                member = group["members"][lost[0]]
                self._group_failed(job, member["rank"], member["node"], f"its learner {lost[0]} was lost")
                self.ctx.save(job)

    def _busy_learners(self) -> set[str]:
        return {name for job in self.ctx.jobs.values() if job.status == RUNNING and job.group
                for name in job.group["members"]}

    def _launch(self, job: SchedJob) -> bool:
        """Pick, rank and launch the group if enough learners are free; False to wait."""
        spec, group = job.spec.ddp, job.group
        assert spec is not None and group is not None
        taken = self._busy_learners()
        free = [info for info in self.ctx.registry.alive()
                if info.learner not in taken and not info.busy and not info.group
                and (not spec.nodes or info.node in spec.nodes)]
        if len(free) < spec.world_size:
            return False
        master = spec.master_node or _first_node(free)
        order = sorted(free, key=lambda i: (i.node != master, i.node, i.replica, i.learner))
        chosen = order[: spec.world_size]
        ranks = assign_ranks([(i.learner, i.node, i.replica) for i in chosen], master)
        master_addr = spec.master_addr or next(i.node for i in chosen if ranks[i.learner].rank == 0)
        backend = spec.backend
        if backend == "auto":
            backend = "nccl" if all(i.device.startswith("cuda") for i in chosen) else "gloo"
        group["members"] = {i.learner: {"rank": ranks[i.learner].rank, "node": i.node} for i in chosen}
        group["exits"], group["started"] = {}, time.time()
        group["master_addr"], group["backend"] = master_addr, backend  # for `status`: what ran
        for info in chosen:
            r = ranks[info.learner]
            launch = DdpLaunch(
                job_id=job.job_id, attempt=group["attempt"], rank=r.rank, local_rank=r.local_rank,
                node_rank=r.node_rank, world_size=r.world_size, master_addr=master_addr,
                master_port=spec.master_port, backend=backend, spec=job.raw_spec,
                resume_digest=group["checkpoint"],
            )
            self.ctx.bus.publish(topology.learner_queue(info.learner), to_wire(launch))
        job.round = 1
        log.info("ddp_launched", attempt=group["attempt"], master=master_addr, backend=backend,
                 members={name: m["rank"] for name, m in group["members"].items()},
                 resume=group["checkpoint"][:12])
        self.ctx.event(job.job_id, "round_started", round=1, data={
            "clients": spec.world_size, "attempt": group["attempt"],
            "ranks": {name: m["rank"] for name, m in group["members"].items()},
        })
        return True

    # -- what the learners and the aggregator say --------------------------------------------

    def exited(self, job: SchedJob, msg: DdpExit) -> None:
        group = job.group
        if group is None or msg.attempt != group["attempt"] or not group["members"]:
            log.info("ddp_exit_stale", attempt=msg.attempt, rank=msg.rank)
            return
        member = group["members"].get(msg.learner)
        if member is None or member["rank"] != msg.rank:  # only the learner running that rank says so
            log.warning("ddp_exit_refused", learner=msg.learner, rank=msg.rank)
            return
        group["exits"][str(msg.rank)] = msg.code
        log.info("ddp_rank_exited", rank=msg.rank, node=msg.node, code=msg.code)
        if msg.code != 0:
            last = next((line for line in reversed(msg.tail.splitlines()) if line.strip()), "")
            reason = f"exit code {msg.code}" + (f": {last}" if last else "")
            self._group_failed(job, msg.rank, msg.node, reason)
            return
        self._maybe_done(job)

    def progress(self, job: SchedJob, msg: DdpProgress) -> None:
        """A rank's output lines and rank 0's reports: to the job's watchers, its row, Prometheus."""
        group = job.group
        current = group is not None and msg.attempt == group["attempt"]
        member = group["members"].get(msg.learner) if group is not None and current else None
        if group is None or member is None or member["rank"] != msg.rank:
            log.info("ddp_progress_stale", learner=msg.learner, attempt=msg.attempt, rank=msg.rank)
            return
        reports = [r.model_dump(exclude_none=True) for r in msg.reports] if msg.rank == 0 else []
        if reports:
            kept = group.setdefault("reports", [])
            kept.extend(reports)
            del kept[:-KEPT_REPORTS]
            last = reports[-1]
            self.ctx.metrics.ddp_step.labels(job.job_id).set(last["step"])
            self.ctx.metrics.round_metrics(job.job_id, {"train": last["metrics"]})
        self.ctx.event(job.job_id, "progress", round=job.round, data={
            "rank": msg.rank, "node": msg.node, "attempt": msg.attempt, "lines": msg.lines,
            "dropped": msg.dropped, "reports": reports,
        })

    def stored(self, job: SchedJob, msg: DdpStored) -> None:
        group = job.group
        if group is None or msg.attempt != group["attempt"]:
            return
        if msg.kind == "checkpoint":
            group["checkpoint"], group["step"] = msg.digest, msg.step
            log.info("ddp_checkpoint", step=msg.step, digest=msg.digest[:12])
            return
        group["final"] = {"digest": msg.digest, "model_path": msg.model_path}
        job.model_digest, job.model = msg.digest, b""
        self._maybe_done(job)

    def _maybe_done(self, job: SchedJob) -> None:
        group = job.group
        assert group is not None and job.spec.ddp is not None
        if len(group["exits"]) < job.spec.ddp.world_size or group["final"] is None:
            return
        reports = group.get("reports", [])
        record = {
            "round": 1, "metrics": {"train": reports[-1]["metrics"]} if reports else {},
            "reports": reports, "clients": job.spec.ddp.world_size, "failed": 0, "num_examples": 0,
            "seconds": time.time() - group["started"], "model_digest": group["final"]["digest"],
            "model_path": group["final"]["model_path"], "sync": {},
            "attempts": group["attempt"] + 1,
        }
        job.history.append(record)
        self.ctx.event(job.job_id, "round_completed", round=1, data=record)
        group["members"] = {}
        self.ctx.finish(job, COMPLETED, "", model_path=record["model_path"])

    def _group_failed(self, job: SchedJob, rank: int, node: str, reason: str) -> None:
        """Tear the group down; start it again from the last checkpoint, or fail the job."""
        group = job.group
        assert group is not None and job.spec.ddp is not None
        for name in group["members"]:
            stop = DdpStop(job_id=job.job_id, attempt=group["attempt"])
            self.ctx.bus.publish(topology.learner_queue(name), to_wire(stop))
        used = job.spec.ddp.max_restarts - group["restarts_left"]
        if group["restarts_left"] <= 0:
            group["members"] = {}
            self.ctx.finish(job, FAILED, (
                f"DDP rank {rank} on node {node} failed: {reason}; {used} of {job.spec.ddp.max_restarts} "
                "restarts used (ddp.max_restarts)"
            ))
            return
        log.warning("ddp_restart", rank=rank, node=node, reason=reason[:300], attempt=group["attempt"] + 1,
                    resume=group["checkpoint"][:12])
        group["restarts_left"] -= 1
        group["attempt"] += 1
        group["members"], group["exits"], group["final"], group["reports"] = {}, {}, None, []
        self._launch(job)


def _first_node(infos: list[LearnerInfo]) -> str:
    return sorted(info.node for info in infos)[0]
