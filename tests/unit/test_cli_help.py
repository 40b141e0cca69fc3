"""`fedmq --help` and every command's: a flag shows no value type (no `--json <bool>`); the
README's command table lists every command, in `fedmq --help`'s order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fedmq.services.cli.main import app

COMMANDS = ["run", "scheduler", "aggregator", "learner", "submit", "watch", "status", "cancel", "learners",
            "gpu-mapping", "model", "plot", "schema"]


def help_of(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    return result.output


def test_fedmq_help_lists_every_command_and_shows_no_bool_type() -> None:
    text = help_of()
    assert "<bool>" not in text
    assert [line.split()[1] for line in text.splitlines() if line.split()[1:2] and line.split()[1] in COMMANDS
            ] == COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flag_of_a_command_shows_a_type_and_options_with_values_still_do(command: str) -> None:
    text = help_of(command)
    assert "<bool>" not in text
    flags = [line for line in text.splitlines() if "--help" in line]
    assert flags and all(line.split()[2] == "Show" for line in flags), flags


def test_an_option_that_takes_a_value_keeps_its_type() -> None:
    rounds = next(line for line in help_of("run").splitlines() if "--rounds" in line)
    assert "<int>" in rounds


def test_the_readmes_command_table_has_every_command_in_help_order() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `fedmq ([a-z-]+)", table, flags=re.MULTILINE)
    assert listed == list(typer.main.get_command(app).commands) == COMMANDS  # type: ignore[attr-defined]
