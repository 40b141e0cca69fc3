"""The scheduler's job rows: the history appended round by round, read back whole, old rows migrated."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from fedmq.common.jobspec import parse_job
from fedmq.services.scheduler.jobs import SchedJob
from fedmq.services.scheduler.store import JobRows

RAW = {"name": "t", "task": "digits", "clients": {"total": 2}, "rounds": 50}


def job(history: int) -> SchedJob:
    made = SchedJob("job-1", parse_job(RAW), RAW, round=history)
    made.history = [{"round": r, "metrics": {"server": {"accuracy": r / 100}}} for r in range(1, history + 1)]
    return made


def test_each_save_appends_the_new_rounds_and_a_reopened_store_reads_them_all(tmp_path: Path) -> None:
    rows = JobRows(tmp_path / "jobs.sqlite")
    rows.open()
    kept = job(0)
    for r in range(1, 6):
        kept.history.append({"round": r, "metrics": {}})
        kept.round = r
        rows.save(kept)
        rows.save(kept)  # a message handled twice (redelivered): nothing written twice
    again = JobRows(tmp_path / "jobs.sqlite")
    again.open()
    [loaded] = again.load()
    assert loaded["history"] == kept.history and loaded["round"] == 5
    db = sqlite3.connect(tmp_path / "jobs.sqlite")
    assert db.execute("SELECT count(*) FROM history").fetchone() == (5,)
    assert "history" not in json.loads(db.execute("SELECT data FROM jobs").fetchone()[0])
    loaded_job = SchedJob(**loaded)
    loaded_job.history.append({"round": 6, "metrics": {}})
    again.save(loaded_job)  # after a restart: appends after what it read
    assert db.execute("SELECT count(*) FROM history").fetchone() == (6,)


def test_a_row_written_with_its_history_inline_is_read_and_moved_to_the_history_table(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "jobs.sqlite")
    db.execute("CREATE TABLE jobs (job_id TEXT PRIMARY KEY, data TEXT NOT NULL)")
    old = job(3)
    row = {"job_id": old.job_id, "raw_spec": RAW, "status": "running", "round": 3, "model_digest": "",
           "config": {}, "history": old.history, "reason": "", "state": None, "sync": {}}
    db.execute("INSERT INTO jobs VALUES (?, ?)", (old.job_id, json.dumps(row)))
    db.commit()
    rows = JobRows(tmp_path / "jobs.sqlite")
    rows.open()
    [loaded] = rows.load()
    assert loaded["history"] == old.history
    rows.save(SchedJob(**loaded))
    assert db.execute("SELECT count(*) FROM history").fetchone() == (3,)


def test_a_jobs_wall_time_runs_from_acceptance_to_its_end_across_a_restart(tmp_path: Path) -> None:
    from fedmq.services.scheduler.status import job_summary

    ended = job(3)
    ended.accepted_at, ended.finished_at, ended.status = 1000.0, 1042.5, "completed"
    ended.history[-1]["seconds"] = 0.5  # the rounds' own times sum to far less than the job took
    assert job_summary(ended, now=0.0, history=False)["wall_seconds"] == 42.5
    rows = JobRows(tmp_path / "jobs.sqlite")
    rows.open()
    rows.save(ended)
    [loaded] = rows.load()
    assert SchedJob(**loaded).wall_seconds == 42.5


def test_rows_without_sync_commit_to_the_kernel_only_and_read_back(tmp_path: Path) -> None:
    synced, unsynced = JobRows(tmp_path / "a.sqlite"), JobRows(tmp_path / "b.sqlite", sync=False)
    for rows in (synced, unsynced):
        rows.open()
        rows.save(job(3))
    assert synced._db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    assert unsynced._db.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL
    again = JobRows(tmp_path / "b.sqlite")
    again.open()
    assert again.load()[0]["history"] == job(3).history
