"""A job's rounds as data: read from what fedmq prints or keeps, one round picked, rows for a CSV.

Every source carries the scheduler's per-round records, {"round", "metrics": {source: {name:
value}}, "clients", "model_digest", ...}, under "history":

    fedmq run --json, fedmq watch --json    {"job_id", "name", "best", "objective", "history", ...}
    fedmq status JOB --json                 [{"job_id", "name", ..., "history"}]
    fedmq plot --json                       {"job_id", "name", "status", "best", "objective", "history"}
    the scheduler's status reply            the row of `status JOB --json`
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fedmq.services.cli.summary import flat

FIELDS = ("round", "clients", "failed", "num_examples", "seconds")  # a CSV's columns before the metrics


@dataclass(frozen=True)
class JobHistory:
    """One job's rounds (sorted) and what picks its best one."""

    job_id: str
    name: str
    records: list[dict[str, Any]]
    status: str = ""
    best: Mapping[str, Any] | None = None  # the scheduler's: round, value, model_digest
    objective: Mapping[str, Any] | None = None  # the spec's: metric, mode
    spec: Mapping[str, Any] | None = field(default=None, repr=False)  # in a status reply only

    @classmethod
    def of(cls, job: Mapping[str, Any]) -> JobHistory:
        """From a job document (see the module's list); ValueError if it has no rounds list."""
        history = job.get("history")
        if not isinstance(history, list) or not all(isinstance(r, dict) and "round" in r for r in history):
            raise ValueError("expected a job with a `history` list of rounds")
        return cls(
            job_id=str(job.get("job_id", "")), name=str(job.get("name", "")),
            records=sorted(history, key=lambda r: int(r["round"])), status=str(job.get("status") or ""),
            best=job.get("best"), objective=job.get("objective"), spec=job.get("spec"),
        )

    def as_json(self) -> dict[str, Any]:
        """What `fedmq plot --json` writes, and `--from` reads back."""
        return {"job_id": self.job_id, "name": self.name, "status": self.status, "best": self.best,
                "objective": self.objective, "history": self.records}

    def title(self) -> str:
        return f"{self.name} ({self.job_id})" if self.name and self.job_id else self.name or self.job_id


def from_document(document: Any, job_id: str | None = None) -> JobHistory:
    """The job `job_id` (or the only one) of a JSON document fedmq wrote; ValueError saying why not."""
    jobs = document if isinstance(document, list) else [document]
    if not all(isinstance(j, dict) for j in jobs):
        raise ValueError("expected fedmq's JSON of a job (`fedmq run --json`, `status JOB --json`)")
    if job_id is not None:
        found = [j for j in jobs if j.get("job_id") == job_id]
        if not found:
            held = ", ".join(str(j.get("job_id")) for j in jobs) or "none"
            raise ValueError(f"no job {job_id} in it (it holds: {held})")
        jobs = found
    if not jobs:
        raise ValueError("it holds no job")
    if len(jobs) > 1:
        held = ", ".join(str(j.get("job_id")) for j in jobs)
        raise ValueError(f"it holds {len(jobs)} jobs: name one ({held})")
    return JobHistory.of(jobs[0])


def metric_names(records: list[dict[str, Any]]) -> list[str]:
    """Every "source.name" any round reported, in the order rounds first report them."""
    return list(dict.fromkeys(name for record in records for name in flat(record)))


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per round: FIELDS, then a column per metric (None where a round has none)."""
    names = metric_names(records)
    out = []
    for record in records:
        metrics = flat(record)
        out.append({**{k: record.get(k) for k in FIELDS}, **{n: metrics.get(n) for n in names}})
    return out


def to_csv(records: list[dict[str, Any]]) -> str:
    """The rows as CSV with a header; a metric a round lacks is an empty cell."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[*FIELDS, *metric_names(records)], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows(records))
    return buffer.getvalue()


Which = Literal["final", "best"] | int


def pick(job: JobHistory, which: Which) -> dict[str, Any]:
    """The record of the round whose model is wanted: the last, the objective's best, or round N.

    LookupError saying why there is none (no rounds yet, no best round, no such round).
    """
    if not job.records:
        raise LookupError(f"job {job.job_id} has no rounds yet")
    by_round = {int(r["round"]): r for r in job.records}
    if which == "final":
        return job.records[-1]
    if which == "best":
        if job.best is not None and int(job.best["round"]) in by_round:
            return by_round[int(job.best["round"])]
        if job.objective is None:
            raise LookupError(f"job {job.job_id} has no objective, so no best round: take the final model "
                              "or one round's")
        names = ", ".join(metric_names(job.records)) or "none"
        raise LookupError(f"job {job.job_id}: no round reported its objective {job.objective['metric']} "
                          f"yet (its metrics: {names})")
    if which not in by_round:
        held = f"rounds {min(by_round)} to {max(by_round)}"
        raise LookupError(f"job {job.job_id} has no round {which} ({held}{_so_far(job)})")
    return by_round[which]


def _so_far(job: JobHistory) -> str:
    return " so far: it is still running" if job.status == "running" else ""


def to_tensorboard(job: JobHistory, folder: Path) -> int:
    """Every round's metrics as TensorBoard scalars (tag `source/name`, step = round) under
    `folder`/`job_id`; the number of scalars written. Needs the tensorboard package."""
    from torch.utils.tensorboard import SummaryWriter

    written = 0
    writer = SummaryWriter(log_dir=str(folder / (job.job_id or "job")))
    try:
        for record in job.records:
            for source, values in (record.get("metrics") or {}).items():
                for name, value in (values or {}).items():
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        writer.add_scalar(f"{source}/{name}", float(value), int(record["round"]))
                        written += 1
    finally:
        writer.close()
    return written
