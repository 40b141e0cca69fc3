"""The summary `fedmq run` prints at the end: the best round or why there is none, where the model is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from fedmq.services.cli.render import print_summary


def summary(**result: Any) -> str:
    console = Console(record=True, width=60, color_system=None)
    print_summary(console, {
        "status": "completed", "name": "job", "job_id": "job-1", "rounds": 2, "wall_seconds": 1.0,
        "final": {"server.accuracy": 0.9}, **result,
    })
    return console.export_text()


def test_the_best_round_is_shown_or_why_there_is_none() -> None:
    objective = {"metric": "server.accuracy", "mode": "max"}
    best = summary(objective=objective, best={"round": 2, "value": 0.9})
    assert "best server.accuracy (max): 0.9000 in round 2" in best
    typo = summary(objective={"metric": "server.acuracy", "mode": "max"}, best=None)
    assert "objective server.acuracy was never reported" in typo and "server.accuracy" in typo


def test_the_model_path_stays_on_one_line_and_the_tasks_artifacts_are_named(tmp_path: Path) -> None:
    folder = tmp_path / ("a-long-folder-name-" * 4) / "job-1"
    (folder / "artifacts").mkdir(parents=True)
    (folder / "artifacts" / "samples.png").write_bytes(b"png")
    text = summary(model_path=str(folder / "model.safetensors"))
    assert str(folder / "model.safetensors") in text.splitlines()[-3]
    assert f"the Task's artifacts are in {folder / 'artifacts'}" in text
