"""A learner's rank of a DDP group: the entry as a child process, watched until it exits.

    DdpLaunch ─▶ fetch the checkpoint to resume from (if any) ─▶ child: python -m ...ddp_child
        │          with MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, NODE_RANK set
        ├─ its output, and rank 0's reports (fedmq.ddp.report) ─▶ DdpProgress ─▶ scheduler ─▶ watch
        │    every POLL_S (and this learner's log; the last lines go with its exit too)
        ├─ rank 0: each checkpoint the entry saves (fedmq.ddp) ─▶ DdpModel ─▶ aggregator
        └─ exit ─▶ rank 0 and 0: the final model ─▶ aggregator; then DdpExit(code) ─▶ scheduler
    DdpStop ─▶ the child is terminated (SIGTERM, then SIGKILL)

One group at a time; while it runs the learner takes no federated tasks (service.on_task).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pydantic
import structlog
import torch

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.checkpoint import load_state, save_state
from fedmq.common.jobspec import parse_job
from fedmq.common.messages import DdpExit, DdpLaunch, DdpModel, DdpProgress, DdpReport, DdpStop, to_wire
from fedmq.common.statefiles import JOB_ID
from fedmq.ddp import REPORTS

log = structlog.get_logger("fedmq.learner")

POLL_S = 0.5  # how often a rank's new output, reports and checkpoint are sent
STOP_GRACE_S = 5.0
TAIL_LINES = 40
PENDING_LINES = 2000  # output lines waiting to be sent; more are dropped (and counted)
PER_MESSAGE = 200  # lines, or reports, in one DdpProgress

Fetch = Callable[[str, str], tuple[dict[str, torch.Tensor], int]]


class DdpRunner:
    def __init__(self, bus: Bus, name: str, node: str, state_dir: Path, fetch: Fetch) -> None:
        self.bus = bus
        self.name = name
        self.node = node
        self.state_dir = state_dir
        self.fetch = fetch
        self._lock = threading.Lock()
        self._key: tuple[str, int] | None = None  # (job, attempt) of the rank this learner runs
        self._child: subprocess.Popen[bytes] | None = None
        self._stopped = False

    @property
    def active(self) -> bool:
        return self._key is not None

    @property
    def group(self) -> str:
        """`job/attempt`, for the heartbeat and `fedmq learners`; '' when in no group."""
        key = self._key
        return "" if key is None else f"{key[0]}/{key[1]}"

    def launch(self, msg: DdpLaunch, entry_checked: Callable[[str], None]) -> None:
        """Start the rank in a thread of its own (the fetch and the wait are not the bus thread's)."""
        with self._lock:
            if self._key == (msg.job_id, msg.attempt):
                log.info("ddp_launch_duplicate", job=msg.job_id, attempt=msg.attempt)
                return
            if self._key is not None:
                self._terminate()  # the scheduler has moved on: this learner's old rank is over
            self._key, self._stopped = (msg.job_id, msg.attempt), False
        threading.Thread(target=self._run, args=(msg, entry_checked), name="ddp-rank", daemon=True).start()

    def stop(self, msg: DdpStop) -> None:
        with self._lock:
            if self._key == (msg.job_id, msg.attempt):
                self._stopped = True
                self._terminate()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._terminate()

    def _terminate(self) -> None:
        child = self._child
        if child is None or child.poll() is not None:
            return
        child.terminate()
        try:
            child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()

    def _run(self, msg: DdpLaunch, entry_checked: Callable[[str], None]) -> None:
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        with structlog.contextvars.bound_contextvars(job=msg.job_id, attempt=msg.attempt, rank=msg.rank):
            try:
                code = self._child_run(msg, entry_checked, tail)
            except Exception as exc:  # could not start it: a failure of this rank, said to the scheduler
                log.warning("ddp_rank_failed", error=f"{type(exc).__name__}: {exc}"[:500])
                tail.append(f"fedmq: {type(exc).__name__}: {exc}")
                code = 1
            with self._lock:
                stopped, self._child = self._stopped, None
                if self._key == (msg.job_id, msg.attempt):
                    self._key = None
            log.info("ddp_rank_exited", code=code, stopped=stopped)
            exit_msg = DdpExit(job_id=msg.job_id, attempt=msg.attempt, rank=msg.rank, learner=self.name,
                               node=self.node, code=code, tail="\n".join(tail)[-8000:])
            self.bus.publish(topology.SCHEDULER, to_wire(exit_msg))

    def _child_run(
        self, msg: DdpLaunch, entry_checked: Callable[[str], None], tail: collections.deque[str]
    ) -> int:
        if not JOB_ID.fullmatch(msg.job_id):
            raise ValueError(f"job id {msg.job_id[:80]!r} cannot name a folder")
        spec = parse_job(msg.spec)
        if spec.ddp is None:
            raise ValueError("a DDP launch for a job that is not a DDP job")
        entry_checked(spec.ddp.entry)
        folder = self.state_dir / "ddp" / msg.job_id / f"attempt-{msg.attempt}" / f"rank-{msg.rank}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        env = {
            **os.environ,
            "MASTER_ADDR": msg.master_addr, "MASTER_PORT": str(msg.master_port),
            "WORLD_SIZE": str(msg.world_size), "RANK": str(msg.rank), "LOCAL_RANK": str(msg.local_rank),
            "NODE_RANK": str(msg.node_rank), "FEDMQ_DDP_ENTRY": spec.ddp.entry, "FEDMQ_DDP_DIR": str(folder),
            "FEDMQ_DDP_OPTIONS": json.dumps(spec.ddp.options), "FEDMQ_DDP_BACKEND": msg.backend,
            "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH", "")])),
        }
        if msg.resume_digest:
            weights, _ = self.fetch(msg.job_id, msg.resume_digest)
            step = weights.pop("__fedmq_step", torch.zeros(1, dtype=torch.int64))
            save_state(folder / "resume.safetensors", weights, {"fedmq.step": str(int(step.reshape(-1)[0]))})
            env["FEDMQ_DDP_RESUME"] = str(folder / "resume.safetensors")
        with self._lock:
            if self._stopped:
                return -15
            self._child = child = subprocess.Popen(
                [sys.executable, "-m", "fedmq.services.learner.ddp_child"], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )
        log.info("ddp_rank_started", pid=child.pid, world_size=msg.world_size, master=msg.master_addr)
        progress = _Progress(folder / REPORTS if msg.rank == 0 else None)
        reader = threading.Thread(target=_read_output, args=(child, tail, progress), daemon=True)
        reader.start()
        seen = 0.0
        try:
            while child.poll() is None:
                try:
                    if msg.rank == 0:
                        seen = self._send_checkpoint(msg, folder, seen)
                    self._send_progress(msg, progress)
                except Exception as exc:  # the broker, or a half-written file: tried again next poll
                    log.warning("ddp_progress_send_failed", error=str(exc)[:300])
                time.sleep(POLL_S)
        finally:
            if child.poll() is None:  # this runner is failing: its child must not run on unwatched
                with self._lock:
                    self._terminate()
        reader.join(5)
        self._send_progress(msg, progress)  # all of it, before the exit that ends the group
        code = child.returncode
        if msg.rank == 0 and code == 0:
            self._send_checkpoint(msg, folder, seen)
            model = folder / "model.safetensors"
            if not model.is_file():
                tail.append("fedmq: rank 0 exited 0 but saved no model (call fedmq.ddp.save_model)")
                return 1
            self._send(msg, "final", load_state(model)[0], 0)
        return code

    def _send_checkpoint(self, msg: DdpLaunch, folder: Path, seen: float) -> float:
        path = folder / "checkpoint.safetensors"
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return seen
        if mtime == seen:
            return seen
        weights, metadata = load_state(path)
        step = int(metadata.get("fedmq.step", "0"))
        weights["__fedmq_step"] = torch.tensor([step], dtype=torch.int64)  # travels with the tensors
        self._send(msg, "checkpoint", weights, step)
        return mtime

    def _send_progress(self, msg: DdpLaunch, progress: _Progress) -> None:
        while True:
            lines, dropped, reports = progress.take(PER_MESSAGE)
            if not (lines or dropped or reports):
                return
            update = DdpProgress(job_id=msg.job_id, attempt=msg.attempt, rank=msg.rank, learner=self.name,
                                 node=self.node, lines=lines, dropped=dropped, reports=reports)
            self.bus.publish(topology.SCHEDULER, to_wire(update))

    def _send(self, msg: DdpLaunch, kind: str, weights: dict[str, torch.Tensor], step: int) -> None:
        model = DdpModel(job_id=msg.job_id, attempt=msg.attempt, kind=kind, step=step,
                         spec=msg.spec, weights=weights)
        self.bus.publish(topology.AGGREGATOR, to_wire(model))
        log.info("ddp_model_sent", kind=kind, step=step)


class _Progress:
    """A rank's output lines not yet sent (at most PENDING_LINES) and its report file's unread part."""

    def __init__(self, reports: Path | None) -> None:
        self._lock = threading.Lock()
        self._lines: collections.deque[str] = collections.deque()
        self._dropped = 0
        self._reports, self._offset = reports, 0
        self._unread: list[DdpReport] = []

    def add(self, line: str) -> None:
        with self._lock:
            if len(self._lines) >= PENDING_LINES:
                self._lines.popleft()
                self._dropped += 1
            self._lines.append(line[:1000])

    def take(self, most: int) -> tuple[list[str], int, list[DdpReport]]:
        """Up to `most` lines (with how many were dropped before them) and reports, oldest first."""
        self._read_reports()
        with self._lock:
            lines = [self._lines.popleft() for _ in range(min(most, len(self._lines)))]
            dropped, self._dropped = self._dropped, 0
        reports, self._unread = self._unread[:most], self._unread[most:]
        return lines, dropped, reports

    def _read_reports(self) -> None:
        """The whole lines written since the last read (fedmq.ddp.report appends one per call)."""
        if self._reports is None:
            return
        try:
            with open(self._reports, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(1 << 20)
        except FileNotFoundError:
            return
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(whole)
        for raw in whole.splitlines():
            try:
                self._unread.append(DdpReport.model_validate_json(raw))
            except pydantic.ValidationError as exc:
                why = exc.errors()[0]
                self.add(f"fedmq: a report was left out ({why['msg']} at {why['loc']}): {raw[:200]!r}")


def _read_output(child: subprocess.Popen[bytes], tail: collections.deque[str], progress: _Progress) -> None:
    assert child.stdout is not None
    for raw in child.stdout:
        line = raw.decode(errors="replace").rstrip()
        tail.append(line)
        progress.add(line)
        log.info("ddp_output", line=line[:1000])
