"""A `fedmq run` stopped by Ctrl-C, kept in its state directory so that `--resume` goes on.

    STATE/embedded/paused/    written when the run stops in order, removed when it resumes
        pause.json            {"paused_at": wall-clock seconds, "messages": [[queue, file, user], ...]}
        0000000.msg ...       each message's body: the bytes that were on the bus

Jobs and rounds are the services' own state (the scheduler's rows, the aggregator's
checkpoints), which they resume from on start. What only the in-memory broker held is kept
here: on RabbitMQ the broker keeps it between the services' lives, but in one process it dies
with the process, and a resumed round would wait for its deadline to send its tasks again, or
never see a RoundOpen that was still queued.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus, Delivery
from fedmq.common.bus.memory import MemoryBroker
from fedmq.services.scheduler.jobs import RUNNING, SchedJob
from fedmq.services.scheduler.store import JobRows


def _paused(state_dir: Path) -> Path:
    return Path(state_dir) / "embedded" / "paused"


def save(state_dir: Path, broker: MemoryBroker) -> int:
    """Move what the broker's work queues hold into the state directory; returns how many.

    Only once every service's bus has stopped: nothing may publish meanwhile.
    """
    final = _paused(state_dir)
    partial = final.with_name("paused.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    index: list[tuple[str, str, str]] = []

    def keep(delivery: Delivery) -> None:
        if delivery.reply_to is None:  # a request's asker is gone with this process
            name = f"{len(index):07d}.msg"
            (partial / name).write_bytes(delivery.body)
            index.append((delivery.queue, name, delivery.user_id or "guest"))
        delivery.ack()

    bus = broker.connect()
    for queue in topology.QUEUES:
        if depth := broker.depth(queue):
            bus.consume(queue, keep, prefetch=depth)  # all of them handed over at once, in order
    bus.stop()  # queued behind those hand-overs: run() handles every one of them, then returns
    bus.run()
    (partial / "pause.json").write_text(json.dumps({"paused_at": time.time(), "messages": index}))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)  # whole or not at all
    return len(index)


@dataclass
class Pause:
    """A stopped run's saved messages, and when it stopped."""

    path: Path
    paused_at: float
    messages: list[tuple[str, str, str]]

    def replay(self, broker: MemoryBroker) -> None:
        """Publish the saved messages again, each to its queue, in order, as its sender; then forget them."""
        buses: dict[str, Bus] = {}
        for queue, name, user in self.messages:
            bus = buses.setdefault(user, broker.connect(user))
            bus.publish(queue, (self.path / name).read_bytes())
        shutil.rmtree(self.path)


def load(state_dir: Path) -> Pause | None:
    """The pause a Ctrl-C left in `state_dir`, if any."""
    path = _paused(state_dir)
    try:
        record = json.loads((path / "pause.json").read_text())
    except FileNotFoundError:
        return None
    # A pause saved before senders were kept: as `guest`, what an unconfigured broker would say.
    messages = [(m[0], m[1], m[2] if len(m) > 2 else "guest") for m in record["messages"]]
    return Pause(path, float(record["paused_at"]), messages)


def discard(state_dir: Path) -> None:
    """Forget a pause (its job never began)."""
    shutil.rmtree(_paused(state_dir), ignore_errors=True)


def _rows(state_dir: Path) -> JobRows | None:
    # The scheduler's store (services/scheduler/service.py puts it here), read before it starts.
    path = Path(state_dir) / "scheduler" / "jobs.sqlite"
    if not path.is_file():
        return None
    rows = JobRows(path)
    rows.open()
    return rows


def stored_jobs(state_dir: Path) -> list[SchedJob]:
    """Every job the scheduler has recorded in `state_dir`, finished or not."""
    rows = _rows(state_dir)
    return [] if rows is None else [SchedJob(**fields) for fields in rows.load()]


def shift_deadlines(state_dir: Path, seconds: float) -> None:
    """Give every open round the time the run spent stopped, so a pause closes no round early."""
    rows = _rows(state_dir)
    if rows is None:
        return
    for fields in rows.load():
        job = SchedJob(**fields)
        if job.status == RUNNING and job.state is not None:
            job.state.deadline += seconds
            job.state.started += seconds
            rows.save(job)
