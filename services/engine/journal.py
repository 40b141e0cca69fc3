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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmq.common import statefiles
from fedmq.common.jobspec import JobSpec

if TYPE_CHECKING:
    from fedmq.services.engine.engine import Progress

FILE = "journal.json"


@dataclass(frozen=True)
class StoredJob:
    """A job the engine ran in a state directory, as its journal last said."""

    job_id: str
    spec: JobSpec
    status: str
    round: int
    history: list[dict[str, Any]]
    best: dict[str, Any] | None
    written_at: float  # when its journal was last written (seconds since the epoch)


class Journal:
    """One job's journal file."""

    def __init__(self, root: Path, job_id: str, sync: bool = True) -> None:
        self.path = Path(root) / job_id / FILE
        self.job_id = job_id
        self.sync = sync
        self._spec = ""

    def start(self, spec_json: str) -> None:
        """A new job: its spec, before round 0."""
        self._spec = spec_json
        self._write({"status": "running", "round": -1, "history": [], "best": None, "config": {}})

    def save(self, progress: Progress, status: str) -> None:
        self._write(_of(progress) | {"status": status})

    def finish(self, progress: Progress, final: dict[str, Any]) -> None:
        """The job's end: every round it completed, and its final status, reason and model."""
        self._write(_of(progress) | {"status": final["status"], "final": final})

    def load(self) -> Progress | None:
        """The rounds as the last checkpoint left them; None if the job never reached one."""
        from fedmq.services.engine.engine import Progress

        doc = _read(self.path)
        if doc is None or doc["round"] < 0:
            return None
        self._spec = doc["spec"]
        return Progress(round=doc["round"], history=doc["history"], best=doc["best"], config=doc["config"])

    def _write(self, fields: dict[str, Any]) -> None:
        if not self._spec:
            doc = _read(self.path)
            self._spec = doc["spec"] if doc else "{}"
        doc = {"job_id": self.job_id, "spec": self._spec, **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        statefiles.atomic_write(self.path, json.dumps(doc).encode(), self.sync)


def stored_jobs(state_dir: Path) -> list[StoredJob]:
    """The jobs the engine ran in `state_dir`, oldest first."""
    root = Path(state_dir) / "engine"
    found = []
    for path in sorted(root.glob(f"*/{FILE}"), key=lambda p: p.stat().st_mtime):
        doc = _read(path)
        if doc is None or doc.get("spec") in (None, "{}"):
            continue
        found.append(StoredJob(job_id=doc["job_id"], spec=JobSpec.model_validate_json(doc["spec"]),
                               status=doc["status"], round=max(int(doc["round"]), 0),
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
