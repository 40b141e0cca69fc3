"""The target lines `make bench` gathers (benchmarks/targets.py): the goal judged as printed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


targets = _load("targets")


def test_a_ratio_over_its_limit_is_not_met_and_its_line_reads_back(
    capsys: pytest.CaptureFixture[str]) -> None:
    printed = targets.emit("round", "a round", figure=0.12, baseline=0.02, unit="s", at_most=3.0)
    line = capsys.readouterr().out
    assert line.count("\n") == 1  # one JSON line
    assert json.loads(line) == printed
    assert targets.parse(line) == printed
    assert printed["ratio"] == pytest.approx(6.0) and printed["met"] is False
    assert printed["goal"] == "ratio <= 3"


def test_a_figure_goal_and_a_given_ratio_are_judged_on_what_they_name() -> None:
    update = targets.emit("update", "per update", figure=0.0004, baseline=0.002, unit="s", at_most=0.0005,
                          on="figure")
    assert update["met"] is True and update["ratio"] == pytest.approx(0.2)
    transfer = targets.emit("transfer", "vs raw", figure=1.6, baseline=1.2, unit="s", ratio=1.2 / 1.6,
                            at_least=0.85)
    assert transfer["met"] is False and transfer["goal"] == "ratio >= 0.85"


def test_a_goal_that_does_not_apply_is_neither_met_nor_missed() -> None:
    line = targets.emit("gpu", "outside training", figure=2.5, baseline=12.0, unit="s", at_most=1.0,
                        on="figure", applies=False, why_not="ran on the CPU")
    assert line["met"] is None and line["why_not_applicable"] == "ran on the CPU"


def test_a_target_needs_exactly_one_bound() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        targets.emit("x", "x", figure=1.0, baseline=1.0, unit="s")
    with pytest.raises(ValueError, match="exactly one"):
        targets.emit("x", "x", figure=1.0, baseline=1.0, unit="s", at_most=1.0, at_least=0.5)


def test_other_output_lines_are_not_targets() -> None:
    for line in ['{"benchmark": "job_length", "ratio": 1.0}', "{", "2026-11-26 [info] bus_stats",
                 '{"target": "broken', ""]:
        assert targets.parse(line) is None


def test_a_line_missing_a_field_is_not_a_target() -> None:
    assert targets.parse('{"target": "x", "met": true}') is None


def test_the_table_keeps_a_bar_inside_its_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gather = _load("all")
    line = targets.emit("t", "a | b", figure=2.0, baseline=1.0, unit="s", at_most=3.0)
    row = gather.table([{**line, "benchmark": "x.py"}]).splitlines()[-1]
    assert row.count(" | ") == 5 and "a \\| b" in row and row.endswith("| **yes** |")


def test_the_job_length_trend_is_the_line_through_most_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    job_length = _load("job_length")
    rounds = {r: 0.05 + 0.0001 * r for r in range(10, 600)}
    rounds |= {r: 1.0 for r in range(300, 320)}  # a burst of slow rounds: not the trend
    first, last = job_length.trend(rounds, 10, 600)
    assert first == pytest.approx(0.051) and last == pytest.approx(0.11)


def test_a_benchmark_run_keeps_its_targets_through_a_bad_byte_and_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gather = _load("all")
    line = '{"target": "t", "what": "w", "figure": 1, "baseline": 1, "ratio": 1, "unit": "s", ' \
           '"goal": "ratio <= 1", "met": true}'
    (tmp_path / "fake.py").write_text(
        "import sys\n"
        "sys.stdout.buffer.write(b'log \\xff\\n'); sys.stdout.flush()\n"
        f"print({line!r})\n"
        "sys.exit(3)\n"
    )
    monkeypatch.setattr(gather, "HERE", tmp_path)
    code, found, report = gather.run("fake", ["--x"])
    assert code == 3
    assert found == [{**json.loads(line), "benchmark": "fake.py --x"}]
    assert report is None  # it printed only a target line
    assert "log \ufffd" in capsys.readouterr().out  # shown as it came, the bad byte replaced


def test_a_benchmarks_report_is_its_first_json_object_that_is_no_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gather = _load("all")
    target = targets.emit("t", "w", figure=2.0, baseline=1.0, unit="s", at_most=3.0)
    output = (f"log {{not json}}\n{json.dumps(target)}\n"
              + json.dumps({"rounds": 3, "cases": [{"a": 1}]}, indent=2) + "\n{\"later\": 1}\n")
    assert gather.report_in(output) == {"rounds": 3, "cases": [{"a": 1}]}
    assert gather.report_in(f"{json.dumps(target)}\nno report\n") is None
