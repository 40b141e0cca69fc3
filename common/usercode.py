"""Calls into user code go through one wrapper: whatever it raises becomes a UserCodeError saying where.

    with user_code("train", round=3, client=17):
        metrics = train_fn(model, ...)

A user's model builder, data loader, training or evaluation may raise anything. No service
can know whether the next call would do better, and the same code runs for every client, so
the error is the job's (the scheduler fails it, naming phase, type and message) rather than a
message's (dead-lettered, and the job left waiting) or one client's (quorum lost round after round).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fedmq.common.allowlist import CodeNotAllowed
from fedmq.common.errors import FedmqError, StateUnwritable
from fedmq.common.messages import UserError

MESSAGE_CHARS = 1000  # a traceback's last line can be huge (a tensor's repr): the start says enough


class UserCodeError(FedmqError):
    """User code raised: in which phase (and round and client, where known), what type, what message."""

    def __init__(
        self, phase: str, error_type: str, message: str, *,
        round: int | None = None, client: int | None = None,
    ) -> None:
        super().__init__(f"{phase} raised {error_type}: {message}")
        self.phase = phase
        self.error_type = error_type
        self.message = message
        self.round = round
        self.client = client

    def info(
        self, service: str, *, round: int | None = None, client: int | None = None, learner: str = ""
    ) -> UserError:
        """The error as it travels to the scheduler, completed with what the caller knows."""
        return UserError(
            service=service, phase=self.phase, type=self.error_type, message=self.message,
            round=self.round if self.round is not None else round,
            client=self.client if self.client is not None else client,
            learner=learner,
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
        raise UserCodeError(phase, type(exc).__name__, message, round=round, client=client) from exc
