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
