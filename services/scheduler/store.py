"""The scheduler's durable memory: one SQLite row per job, written before a message is acked.

    jobs(job_id TEXT PRIMARY KEY, data TEXT)   -- data: the job as JSON (spec, status, round,
                                               -- open round's bookkeeping), without its history
    history(job_id, round, data)               -- one row per closed round, written once

A job's history only grows, so each save appends the rounds closed since the last one, in the
same transaction as the job's row: the cost of a save does not grow with the job's length
(before, every message rewrote the whole history: round 600 took 5x round 10's time).

Deadlines are kept as wall-clock times so they survive a restart; the process works with
monotonic ones.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from fedmq.common.errors import StateUnwritable
from fedmq.common.jobspec import parse_job
from fedmq.services.scheduler.jobs import SchedJob
from fedmq.services.scheduler.rounds import RoundState


class JobRows:
    def __init__(self, path: Path, sync: bool = True) -> None:
        """`sync` (FEDMQ_FSYNC): each commit fsynced; else written through to the kernel only (WAL
        mode, synchronous=NORMAL): a killed process loses nothing, a power loss may lose the last
        commits but never corrupts the database."""
        self.path = path
        self.sync = sync
        self._kept: dict[str, int] = {}  # job → history records already on disk

    def open(self) -> None:
        with self._writing():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if self.sync else 'NORMAL'}")
            self._db.execute("CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, data TEXT NOT NULL)")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS history (job_id TEXT NOT NULL, position INTEGER NOT NULL, "
                "data TEXT NOT NULL, PRIMARY KEY (job_id, position))"
            )

    def save(self, job: SchedJob) -> None:
        """One transaction, so all or nothing; StateUnwritable when the disk or database refuses it."""
        kept = self._kept.get(job.job_id, 0)
        new = [(job.job_id, kept + i, json.dumps(record)) for i, record in enumerate(job.history[kept:])]
        with self._writing():
            try:
                self._db.execute("BEGIN")
                self._db.execute(
                    "INSERT INTO jobs (job_id, data) VALUES (?, ?) "
                    "ON CONFLICT(job_id) DO UPDATE SET data = excluded.data",
                    (job.job_id, json.dumps(_to_row(job))),
                )
                self._db.executemany(
                    "INSERT OR REPLACE INTO history (job_id, position, data) VALUES (?, ?, ?)", new
                )
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        self._kept[job.job_id] = len(job.history)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:  # SQLITE_FULL, _IOERR, _READONLY, _CANTOPEN ...
            code = getattr(exc, "sqlite_errorname", "")
            raise StateUnwritable(str(self.path), None, f"{exc} ({code})" if code else str(exc)) from exc
        except OSError as exc:
            raise StateUnwritable(str(self.path), exc.errno, exc.strerror or str(exc)) from exc

    def load(self) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT job_id, data FROM jobs ORDER BY rowid").fetchall()
        history: dict[str, list[dict[str, Any]]] = {}
        for job_id, data in self._db.execute("SELECT job_id, data FROM history ORDER BY job_id, position"):
            history.setdefault(job_id, []).append(json.loads(data))
        jobs = []
        for job_id, data in rows:
            row = json.loads(data)
            # A row written before the history table kept its history inline: the next save moves it.
            row["history"] = history.get(job_id) or row.get("history", [])
            self._kept[job_id] = len(history.get(job_id, []))
            jobs.append(_from_row(row))
        return jobs


def _to_row(job: SchedJob) -> dict[str, Any]:
    return {
        "job_id": job.job_id, "raw_spec": job.raw_spec, "status": job.status, "round": job.round,
        "model_digest": job.model_digest, "config": job.config, "reason": job.reason,
        "state": _state_row(job.state), "sync": job.sync, "evaluation": _state_row(job.evaluation),
        "eval_reports": [[c, r] for c, r in job.eval_reports.items()],
        "pending": job.pending,
        "best": job.best,
        "error": job.error, "accepted_at": job.accepted_at, "finished_at": job.finished_at,
        "group": job.group,
        "holders": None if job.holders is None else [[c, *held] for c, held in job.holders.items()],
    }


def _from_row(row: dict[str, Any]) -> dict[str, Any]:
    """Fields for SchedJob(...), with the round states back on the monotonic clock."""
    return {
        **row,
        "spec": parse_job(row["raw_spec"]),
        "state": _state_from_row(row["state"]),
        "evaluation": _state_from_row(row.get("evaluation")),
        "eval_reports": {int(c): r for c, r in row.get("eval_reports", [])},
        "holders": (None if row.get("holders") is None
                    else {int(c): (int(r), str(name), str(tag)) for c, r, name, tag in row["holders"]}),
    }


def _state_row(state: RoundState | None) -> dict[str, Any] | None:
    if state is None:
        return None
    # Field by field, not dataclasses.asdict: its deep copy of every entry was 70% of the
    # scheduler's time per update at 100 clients a round. Every field is a plain value or is
    # rebuilt below; `clients` is copied, as the row may outlive this state.
    row = {f.name: getattr(state, f.name) for f in fields(state)}
    row["clients"] = list(state.clients)
    row["deadline"] = time.time() + (state.deadline - time.monotonic())  # wall clock on disk
    row["started"] = time.time() - (time.monotonic() - state.started)
    row["reported"] = [[c, n] for c, n in state.reported.items()]
    row["failed"] = [[c, r] for c, r in state.failed.items()]
    row["phases"] = [[c, p] for c, p in state.phases.items()]
    row["final"] = sorted(state.final)
    row["learners"] = [[c, name, tag] for c, (name, tag) in state.learners.items()]
    return row


def _state_from_row(row: dict[str, Any] | None) -> RoundState | None:
    if row is None:
        return None
    row = dict(row)
    row["deadline"] = time.monotonic() + (row["deadline"] - time.time())
    row["started"] = time.monotonic() - (time.time() - row["started"])
    row["reported"] = {int(c): int(n) for c, n in row["reported"]}
    row["failed"] = {int(c): str(r) for c, r in row["failed"]}
    row["phases"] = {int(c): str(p) for c, p in row.get("phases", [])}
    row["final"] = {int(c) for c in row.get("final", [])}  # rows written before it: none final
    row["learners"] = {int(c): (str(name), str(tag)) for c, name, tag in row.get("learners", [])}
    return RoundState(**row)
