"""The scheduler's durable memory: one SQLite row per job, written before a message is acked.

    jobs(job_id TEXT PRIMARY KEY, data TEXT)   -- data: the job as JSON (spec, status, round,
                                               -- history, open round's bookkeeping)

Deadlines are kept as wall-clock times so they survive a restart; the process works with
monotonic ones.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedmq.common.errors import StateUnwritable
from fedmq.common.jobspec import parse_job
from fedmq.services.scheduler.jobs import SchedJob
from fedmq.services.scheduler.rounds import RoundState


class JobRows:
    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self) -> None:
        with self._writing():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, data TEXT NOT NULL)")

    def save(self, job: SchedJob) -> None:
        """One statement, so all or nothing; StateUnwritable when the disk or database refuses it."""
        with self._writing():
            self._db.execute(
                "INSERT INTO jobs (job_id, data) VALUES (?, ?) "
                "ON CONFLICT(job_id) DO UPDATE SET data = excluded.data",
                (job.job_id, json.dumps(_to_row(job))),
            )

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
        rows = self._db.execute("SELECT data FROM jobs ORDER BY rowid").fetchall()
        return [_from_row(json.loads(data)) for (data,) in rows]


def _to_row(job: SchedJob) -> dict[str, Any]:
    return {
        "job_id": job.job_id, "raw_spec": job.raw_spec, "status": job.status, "round": job.round,
        "model_digest": job.model_digest, "history": job.history, "reason": job.reason,
        "state": _state_row(job.state), "sync": job.sync, "evaluation": _state_row(job.evaluation),
        "eval_reports": [[c, r] for c, r in job.eval_reports.items()],
        "pending": job.pending,
        "best": job.best,
        "error": job.error, "accepted_at": job.accepted_at,
    }


def _from_row(row: dict[str, Any]) -> dict[str, Any]:
    """Fields for SchedJob(...), with the round states back on the monotonic clock."""
    return {
        **row,
        "spec": parse_job(row["raw_spec"]),
        "state": _state_from_row(row["state"]),
        "evaluation": _state_from_row(row.get("evaluation")),
        "eval_reports": {int(c): r for c, r in row.get("eval_reports", [])},
    }


def _state_row(state: RoundState | None) -> dict[str, Any] | None:
    if state is None:
        return None
    row = asdict(state)
    row["deadline"] = time.time() + (state.deadline - time.monotonic())  # wall clock on disk
    row["started"] = time.time() - (time.monotonic() - state.started)
    row["reported"] = [[c, n] for c, n in state.reported.items()]
    row["failed"] = [[c, r] for c, r in state.failed.items()]
    return row


def _state_from_row(row: dict[str, Any] | None) -> RoundState | None:
    if row is None:
        return None
    row = dict(row)
    row["deadline"] = time.monotonic() + (row["deadline"] - time.time())
    row["started"] = time.monotonic() - (time.time() - row["started"])
    row["reported"] = {int(c): int(n) for c, n in row["reported"]}
    row["failed"] = {int(c): str(r) for c, r in row["failed"]}
    return RoundState(**row)
