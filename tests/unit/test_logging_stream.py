"""Logs go to sys.stderr as it is at each line: a progress bar that redirects it (rich's Live does,
while it draws) prints them above itself rather than through its bar."""

from __future__ import annotations

import io
import sys

import pytest
import structlog

from fedmq.common.logging import configure_logging


def test_a_log_line_goes_to_stderr_as_it_is_when_written(monkeypatch: pytest.MonkeyPatch) -> None:
    configure_logging("json", "warning")
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)  # what a progress bar does while it is live
    structlog.get_logger("fedmq.test").warning("task_failed", error="client 1 has no training data")
    assert '"event": "task_failed"' in later.getvalue()


def test_no_stderr_at_all_loses_the_lines_not_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", None)  # pythonw, some daemons
    monkeypatch.setattr(sys, "__stderr__", None)
    configure_logging("json", "warning")
    structlog.get_logger("fedmq.test").warning("still_running")


def test_a_huge_error_message_leaves_the_traceback_its_frames() -> None:
    import torch

    from fedmq.common.usercode import MESSAGE_CHARS, TRACE_CHARS, UserCodeError, user_code

    def users_function() -> None:
        raise ValueError(repr(torch.arange(100_000)))

    with pytest.raises(UserCodeError) as info, user_code("loss"):
        users_function()
    trace = info.value.trace
    assert trace.startswith("Traceback (most recent call last):") and "in users_function" in trace
    assert len(trace) <= TRACE_CHARS and len(trace.splitlines()[-1]) <= MESSAGE_CHARS + len("ValueError: ")
