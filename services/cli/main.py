"""The `fedmq` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError as PydanticValidationError
from rich.console import Console

from common.errors import ConfigError
from common.jobspec import JobSpec, load_job
from common.logging import configure_logging
from common.settings import Settings

app = typer.Typer(
    name="fedmq",
    help="Federated learning over RabbitMQ: run, submit and watch jobs, or start a service.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

EXIT_FAILED, EXIT_USAGE = 1, 2


@app.callback()
def main() -> None:
    """Federated learning over RabbitMQ."""
    # A user's plug-ins (`my_pkg.mod:build`) live beside their job spec, as with uvicorn.
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")


def _load(job: Path, rounds: int | None, seed: int | None) -> JobSpec:
    overrides: dict[str, Any] = {}
    if rounds is not None:
        overrides["rounds"] = rounds
    if seed is not None:
        overrides["seed"] = seed
    try:
        return load_job(job, overrides)
    except ConfigError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        err.print("Fix the job spec and run again; see examples/ for valid specs.")
        raise typer.Exit(EXIT_USAGE) from None


def _settings(**overrides: Any) -> Settings:
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except PydanticValidationError as exc:
        for e in exc.errors():
            field = ".".join(str(p) for p in e["loc"])
            err.print(f"[red]error:[/] setting FEDMQ_{field.upper()}: {e['msg']}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None


@app.command()
def run(
    job: Annotated[Path, typer.Argument(help="job spec (YAML)")],
    state_dir: Annotated[Path | None, typer.Option(help="where checkpoints and the model go")] = None,
    rounds: Annotated[int | None, typer.Option(help="override the spec's rounds")] = None,
    seed: Annotated[int | None, typer.Option(help="override the spec's seed")] = None,
    learners: Annotated[int, typer.Option(min=1, help="learner threads")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="print the per-round history as JSON")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show service logs")] = False,
) -> None:
    """Train a job in this process on the in-memory bus (no broker needed)."""
    from services.cli.embedded import run_job
    from services.cli.render import RoundProgress, print_summary

    spec = _load(job, rounds, seed)
    settings = _settings(state_dir=state_dir)
    configure_logging(settings.log_format, "info" if verbose else "warning")
    with RoundProgress(err, enabled=not verbose) as progress:
        result = run_job(spec, settings, learners=learners, on_event=progress.update)
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    print_summary(err if json_out else Console(), result)
    if result["status"] != "completed":
        raise typer.Exit(EXIT_FAILED)


if __name__ == "__main__":
    app()
