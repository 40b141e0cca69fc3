"""Calls into user code go through one wrapper: whatever it raises becomes a UserCodeError saying where.

    with user_code("train", round=3, client=17):
        metrics = train_fn(model, ...)

A user's model builder, data loader, training or evaluation may raise anything. No service
can know whether the next call would do better, and the same code runs for every client, so
the error is the job's (the scheduler fails it, naming phase, type and message) rather than a
message's (dead-lettered, and the job left waiting) or one client's (quorum lost round after round).
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedmq.common.allowlist import CodeNotAllowed
from fedmq.common.errors import FedmqError, StateUnwritable
from fedmq.common.messages import UserError

MESSAGE_CHARS = 1000  # a traceback's last line can be huge (a tensor's repr): the start says enough
WHERE_CHARS = 300
TRACE_CHARS = 8000  # the traceback's end: the frames nearest the error


class UserCodeError(FedmqError):
    """User code raised: in which phase (and round and client, where known), what type, what message;
    `where`, the user's own line that raised (file:line in function), and `trace`, the traceback."""

    def __init__(
        self, phase: str, error_type: str, message: str, *,
        round: int | None = None, client: int | None = None, where: str = "", trace: str = "",
    ) -> None:
        super().__init__(f"{phase} raised {error_type}: {message}" + (f" (at {where})" if where else ""))
        self.phase = phase
        self.error_type = error_type
        self.message = message
        self.round = round
        self.client = client
        self.where = where
        self.trace = trace

    def info(
        self, service: str, *, round: int | None = None, client: int | None = None, learner: str = ""
    ) -> UserError:
        """The error as it travels to the scheduler, completed with what the caller knows."""
        return UserError(
            service=service, phase=self.phase, type=self.error_type, message=self.message,
            round=self.round if self.round is not None else round,
            client=self.client if self.client is not None else client,
            learner=learner, where=self.where[:WHERE_CHARS], trace=self.trace[-TRACE_CHARS:],
        )


@contextmanager
def user_code(phase: str, *, round: int | None = None, client: int | None = None) -> Iterator[None]:
    """Run a call into user code; anything it raises comes out as a UserCodeError naming `phase`.

    fedmq's own checks of what user code returned (a ConfigError saying the model's output
    has the wrong shape) count too: they fail the same way for every client. A state write
    that fails inside the block is fedmq's, not the user's, and passes through unchanged, as
    does a refusal to import code outside the allow-list (a wrapper's inner strategy).
    """
    try:
        yield
    except (UserCodeError, StateUnwritable, CodeNotAllowed):
        raise
    except (Exception, SystemExit) as exc:  # SystemExit: a user's sys.exit() must not end a thread
        message = str(exc)[:MESSAGE_CHARS]
        raise UserCodeError(phase, type(exc).__name__, message, round=round, client=client,
                            where=users_line(exc), trace=_trace(exc)) from exc


def users_line(exc: BaseException) -> str:
    """The innermost frame of `exc`'s traceback in the user's own code (not fedmq's, not an
    installed package's, not Python's), as `file:line in function`; "" when there is none."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename)
        if path.suffix != ".py" or _library(path):
            continue
        try:
            shown = str(path.resolve().relative_to(Path.cwd().resolve()))
        except (ValueError, OSError):
            shown = frame.filename
        return f"{shown}:{frame.lineno} in {frame.name}"
    return ""


def _library(path: Path) -> bool:
    """Whether a traceback's file is fedmq's own, an installed package's or the standard library's."""
    resolved = str(path.resolve())
    return any(resolved.startswith(root) for root in _LIBRARY_ROOTS)


def _trace(exc: BaseException) -> str:
    """The traceback's frames, and its last line with the message cut as `message` is: a huge
    message (a tensor's repr) never pushes the frames out of TRACE_CHARS."""
    last = f"{type(exc).__name__}: {str(exc)[:MESSAGE_CHARS]}\n"
    frames = "".join(traceback.format_tb(exc.__traceback__))[-(TRACE_CHARS - len(last) - 40):]
    return f"Traceback (most recent call last):\n{frames}{last}"


_OWN = Path(__file__).resolve().parent  # the repository's common/ (fedmq.common)
_LIBRARY_ROOTS = tuple(sorted({
    str(_OWN) + os.sep, str(_OWN.parent / "services") + os.sep, str(_OWN.parent / "fedmq") + os.sep,
    *(str(Path(p).resolve()) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
      if (p := sysconfig.get_paths().get(key))),
}))
