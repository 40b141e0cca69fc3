"""The `fedmq` Typer app and what its commands share: spec loading, settings, exit codes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError as PydanticValidationError
from rich.console import Console

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import JobSpec, load_job
from fedmq.common.settings import Settings

app = typer.Typer(
    name="fedmq",
    help="Federated learning over RabbitMQ: run, submit and watch jobs, or start a service.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

EXIT_FAILED, EXIT_USAGE = 1, 2
EXIT_UNREACHABLE = 3


def _print_version(value: bool) -> None:
    if value:
        import fedmq

        typer.echo(f"fedmq {fedmq.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="print the version and exit"),
    ] = False,
) -> None:
    """Federated learning over RabbitMQ."""
    # A user's plug-ins (`my_pkg.mod:build`) live beside their job spec, as with uvicorn.
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")


def load_spec(job: Path, rounds: int | None, seed: int | None) -> JobSpec:
    """The job spec with the command line's overrides; exit 2 with the reason if it is invalid."""
    overrides: dict[str, Any] = {}
    if rounds is not None:
        overrides["rounds"] = rounds
    if seed is not None:
        overrides["seed"] = seed
    try:
        spec = load_job(job, overrides)
        from fedmq.common.task.loading import complete_spec  # imports the Task: after the cheap checks

        return complete_spec(spec)
    except ConfigError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        err.print("Fix the job spec and run again; see examples/ for valid specs.")
        raise typer.Exit(EXIT_USAGE) from None


def make_settings(**overrides: Any) -> Settings:
    """Settings from the environment and the given options; exit 2 naming a bad one."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except PydanticValidationError as exc:
        for e in exc.errors():
            field = ".".join(str(p) for p in e["loc"])
            err.print(f"[red]error:[/] setting FEDMQ_{field.upper()}: {e['msg']}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
