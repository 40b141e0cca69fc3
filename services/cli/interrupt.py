"""Ctrl-C while `fedmq run` follows its job: the first stops the run in order, a second quits.

A KeyboardInterrupt raised wherever the main thread happens to be could cut a stop short and
leave torch training on other threads while the interpreter tears down (`terminate called
without an active exception`, exit 134). So the handler raises nothing: it tells the job's
follower, whose `events()` then raises KeyboardInterrupt where the run can stop in order.
It only uses os.write and SimpleQueue.put, both safe inside a signal handler.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any, Protocol

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a process that Ctrl-C ended


SERVICES_STOPPING = ("stopping: learners finish the task they are training, then the services stop "
                     "in order (Ctrl-C again to quit at once)")
ENGINE_STOPPING = ("stopping: the round in progress finishes and is checkpointed "
                   "(Ctrl-C again to quit at once and resume from the last checkpoint)")


class Interruptible(Protocol):
    """What a Ctrl-C tells to stop in order: a job's follower, or the in-process engine."""

    def interrupt(self) -> None: ...


class Interrupt:
    """Installs the handler for SIGINT while in its `with` block (main thread only)."""

    def __init__(self, resume_hint: str, stopping: str = SERVICES_STOPPING) -> None:
        self.resume_hint = resume_hint
        self.stopping = stopping
        self.requested = False
        self._follower: Interruptible | None = None
        self._previous: Any = None

    def __enter__(self) -> Interrupt:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def attach(self, follower: Interruptible) -> None:
        """The follower to interrupt; one that comes after a Ctrl-C is interrupted at once."""
        self._follower = follower
        if self.requested:
            follower.interrupt()

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            _say(f"\ninterrupted again: quitting at once. {self.resume_hint}\n"
                 "  (the round that was open may then wait for its deadline)\n")
            os._exit(EXIT_INTERRUPTED)  # no teardown of anything that still runs: like a crash
        self.requested = True
        _say(f"\n{self.stopping}\n")
        if self._follower is not None:
            self._follower.interrupt()


def _say(text: str) -> None:
    os.write(2, text.encode())
