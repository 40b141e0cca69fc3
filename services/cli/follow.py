"""Following a job from the outside: its events as an iterator, on any bus."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.errors import DecodeError
from fedmq.common.messages import JobEvent, expect, from_wire

TERMINAL = {"completed", "failed", "cancelled"}
READY_S = 30.0  # how long `start` waits for the bus's subscription to be live (then goes on as before)


class JobFollower:
    """Subscribes to one job's events on its own bus thread; iterate to receive them."""

    def __init__(self, bus: Bus, job_id: str) -> None:
        self.bus = bus
        self.job_id = job_id
        self._events: queue.SimpleQueue[JobEvent | None] = queue.SimpleQueue()  # None: interrupted
        self._thread = threading.Thread(target=bus.run, name="follow", daemon=True)

    def start(self) -> JobFollower:
        """Subscribe and run the bus on a thread of our own, live before this returns: a publish
        made meanwhile from this thread found the loop not yet running and used the connection
        while the bus thread opened it (pika: 'NoneType' object has no attribute 'clear')."""
        self.attach()
        self._thread.start()
        self.bus.wait_ready(READY_S)
        return self

    def attach(self) -> JobFollower:
        """Subscribe on a bus that some other thread already runs."""
        self.bus.subscribe(topology.job_topic(self.job_id), self._on_event)
        return self

    def _on_event(self, body: bytes) -> None:
        # Events are advisory: a bad one is skipped, never fatal to a watcher.
        with contextlib.suppress(DecodeError):
            self._events.put(expect(from_wire(body), JobEvent))

    def interrupt(self) -> None:
        """Make `events()` raise KeyboardInterrupt; safe from a signal handler (SimpleQueue.put is)."""
        self._events.put(None)

    def events(self, idle_timeout: float | None = None) -> Iterator[JobEvent]:
        """Yield events until a terminal one; TimeoutError if none comes for idle_timeout s."""
        while True:
            try:
                event = self._events.get(timeout=idle_timeout)
            except queue.Empty:
                raise TimeoutError(f"no news of job {self.job_id} for {idle_timeout}s") from None
            if event is None:
                raise KeyboardInterrupt
            yield event
            if event.kind in TERMINAL:
                return

    def close(self) -> None:
        self.bus.stop()
        self._thread.join(timeout=5)
