"""scripts/device_summary.py: a device check's figures survive the log lines around them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_summary.py"


@pytest.fixture(scope="module")
def summary() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_last_object_on_lines_of_its_own_is_the_result(summary: ModuleType) -> None:
    report = {"benchmark": "gpu_round", "nested": {"a": [1, 2]}}
    text = '{"event": "log line before"}\n' + json.dumps(report, indent=2) + '\n{"event": "log line after"}\n'
    assert summary.last_json(text) == report
    assert summary.last_json("no object\n{ broken\n") is None
    assert summary.last_json(json.dumps({"one": 1}, indent=1) + "\nTraceback: ...\n") == {"one": 1}


def test_each_benchmark_gives_its_figure_and_an_unreadable_log_is_named(
    summary: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fused = {"device": "NVIDIA H100", "cases": {"100_clients_per_round": {
        "sequential_loop_baseline_round_s": 0.5, "fused_round_s": 0.025}}}
    scaling = {"cpus": 16, "runs": {"1": {"throughput_over_first": 1.0}, "8": {"throughput_over_first": 6.5}}}
    (tmp_path / "fused.log").write_text("warming up\n" + json.dumps(fused, indent=2) + "\n")
    (tmp_path / "scaling.log").write_text(json.dumps(scaling, indent=2))
    (tmp_path / "gpu_round.log").write_text("Traceback (most recent call last):\n  ...\n")
    (tmp_path / "gpu_tests.log").write_text("....\n\n12 passed in 3.1s\n")
    summary.main(tmp_path, tmp_path / "results.json")
    printed = capsys.readouterr().out
    assert "20.0x (0.0250 s a round)" in printed
    assert "1: 1.0x, 8: 6.5x" in printed
    assert "gpu_round: no JSON object in its log" in printed
    assert "gpu_tests: 12 passed in 3.1s" in printed
    assert json.loads((tmp_path / "results.json").read_text()) == {"fused": fused, "scaling": scaling}
