"""What a DDP rank's learner sends as it runs: output lines (bounded) and rank 0's reports."""

from __future__ import annotations

from pathlib import Path

import pytest

import fedmq.ddp
from fedmq.services.learner import ddp
from fedmq.services.learner.ddp import _Progress


def test_a_rank_printing_faster_than_it_is_sent_keeps_the_newest_lines_and_counts_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ddp, "PENDING_LINES", 5)
    progress = _Progress(None)
    for i in range(8):
        progress.add(f"line {i}")
    assert progress.take(3) == (["line 3", "line 4", "line 5"], 3, [])
    assert progress.take(3) == (["line 6", "line 7"], 0, [])
    assert progress.take(3) == ([], 0, [])


def test_reports_are_read_whole_lines_at_a_time_and_a_bad_one_is_said_not_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDMQ_DDP_DIR", str(tmp_path))
    progress = _Progress(tmp_path / fedmq.ddp.REPORTS)
    assert progress.take(10) == ([], 0, [])  # no file yet
    fedmq.ddp.report(1, {"loss": 2.5}, total=3)
    with open(tmp_path / fedmq.ddp.REPORTS, "a") as f:
        f.write('{"step": 2, "metrics": {"loss": NaN}}\n{"step": 3, "metr')  # a bad line, half a line
    lines, dropped, reports = progress.take(10)
    assert [(r.step, r.total, r.metrics) for r in reports] == [(1, 3, {"loss": 2.5})]
    assert dropped == 0 and len(lines) == 1 and lines[0].startswith("fedmq: a report was left out")
    with open(tmp_path / fedmq.ddp.REPORTS, "a") as f:
        f.write('ics": {"loss": 1.5}}\n')  # the writer finishes its line
    assert [(r.step, r.metrics) for r in progress.take(10)[2]] == [(3, {"loss": 1.5})]
