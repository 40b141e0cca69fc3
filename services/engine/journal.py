"""The engine's record of a job: what its last checkpoint holds of the rounds, and how it ended.

    STATE/engine/<job>/journal.json   {"job_id", "spec", "status", "round", "history", "best",
                                       "config", "final"}, replaced whole with each checkpoint
    STATE/engine/<job>/...            the aggregator's layout (JobStore): spec, rounds.json,
                                       checkpoints/, clients/, residuals/, model.safetensors

The journal is the commit point: a resumed job goes on from the round it names, whatever a
checkpoint written after it left on disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmq.common import statefiles
from fedmq.common.jobspec import JobSpec

FILE = "journal.json"


@dataclass
class Progress:
    """What the engine knows of its job between rounds; the journal keeps it with each checkpoint."""

    round: int = -1
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredJob:
    """A job the engine ran in a state directory, as its journal last said."""

    job_id: str
    spec: JobSpec
    status: str
    round: int  # of its last checkpoint (-1: none yet)
    history: list[dict[str, Any]]
    best: dict[str, Any] | None
    written_at: float  # when its journal was last written (seconds since the epoch)


class Journal:
    """One job's journal file."""

    def __init__(self, root: Path, job_id: str, spec_json: str, sync: bool = True) -> None:
        self.path = Path(root) / job_id / FILE
        self.job_id = job_id
        self.spec = spec_json
        self.sync = sync

    def start(self) -> None:
        """A new job: its spec, before round 0."""
        self._write({"status": "running", "round": -1, "history": [], "best": None, "config": {},
                     "examples": {}})

    def save(self, progress: Progress, status: str, examples: dict[int, int]) -> None:
        """A checkpoint of round `progress.round` is on disk: the commit point a resume goes on from."""
        self._write(_of(progress) | {"status": status, "examples": {str(c): n for c, n in examples.items()}})

    def finish(self, progress: Progress, final: dict[str, Any]) -> None:
        """The job's end: every round it completed and its final status, reason and model; the round
        of its last checkpoint stays as it was."""
        doc = _read(self.path) or {}
        self._write({**doc, "history": progress.history, "best": progress.best, "status": final["status"],
                     "final": final})

    def load(self) -> tuple[Progress | None, dict[int, int]]:
        """The rounds as the last checkpoint left them, and the clients' first example counts then;
        None if the job never reached a checkpoint, or ended (completed, failed, cancelled)."""
        doc = _read(self.path)
        if doc is None or doc["round"] < 0 or doc["status"] != "running":
            return None, {}
        committed = int(doc["round"])
        history = [record for record in doc["history"] if int(record["round"]) <= committed]
        examples = {int(c): int(n) for c, n in doc.get("examples", {}).items()}
        return Progress(round=committed, history=history, best=doc["best"], config=doc["config"]), examples

    def _write(self, fields: dict[str, Any]) -> None:
        doc = {**fields, "job_id": self.job_id, "spec": self.spec}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        statefiles.atomic_write(self.path, json.dumps(doc).encode(), self.sync)


def stored_jobs(state_dir: Path) -> list[StoredJob]:
    """The jobs the engine ran in `state_dir`, oldest first."""
    root = Path(state_dir) / "engine"
    found = []
    for path in sorted(root.glob(f"*/{FILE}"), key=lambda p: p.stat().st_mtime):
        doc = _read(path)
        if doc is None or not doc.get("spec"):
            continue
        found.append(StoredJob(job_id=doc["job_id"], spec=JobSpec.model_validate_json(doc["spec"]),
                               status=doc["status"], round=int(doc["round"]),
                               history=list(doc.get("history", [])), best=doc.get("best"),
                               written_at=path.stat().st_mtime))
    return found


def cancel(state_dir: Path, job_id: str, reason: str) -> None:
    """Record a job the engine ran as cancelled (its caller stopped following it), if it had begun."""
    path = Path(state_dir) / "engine" / job_id / FILE
    doc = _read(path)
    if doc is None:
        return
    final = {"status": "cancelled", "reason": reason}
    statefiles.atomic_write(path, json.dumps(doc | {"status": "cancelled", "final": final}).encode(), False)


def _of(progress: Progress) -> dict[str, Any]:
    return {"round": progress.round, "history": progress.history, "best": progress.best,
            "config": progress.config}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
