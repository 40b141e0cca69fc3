"""`fedmq --help` and every command's: a flag shows no value type (no `--json <bool>`); the docs'
command table (docs/cli.md) lists every command, in `fedmq --help`'s order, and the README's
shorter table lists only commands that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fedmq.services.cli.main import app

COMMANDS = ["run", "scheduler", "aggregator", "learner", "console", "submit", "watch", "status", "cancel",
            "learners", "gpu-mapping", "model", "plot", "schema"]


REPO = Path(__file__).resolve().parents[2]


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


def commands_in_table(text: str) -> list[str]:
    """The commands of the table under a document's `Commands` heading, in its order."""
    table = re.split(r"(?:^|\n)#+ Commands\n", text, maxsplit=1)[1]
    table = re.split(r"\n#+ ", table, maxsplit=1)[0]
    return re.findall(r"^\| `fedmq ([a-z-]+)", table, flags=re.MULTILINE)


def test_the_docs_command_table_has_every_command_in_help_order() -> None:
    page = (REPO / "docs" / "cli.md").read_text()
    listed = commands_in_table(page)
    assert listed == list(typer.main.get_command(app).commands) == COMMANDS  # type: ignore[attr-defined]


def test_the_readme_lists_five_commands_that_exist_in_help_order() -> None:
    listed = commands_in_table((REPO / "README.md").read_text())
    assert len(listed) == 5 and set(listed) <= set(COMMANDS), listed
    assert listed == [c for c in COMMANDS if c in listed]
