"""`fedmq run`: a whole job in this process, on the in-memory bus."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fedmq.common.logging import configure_logging
from fedmq.services.cli.app import EXIT_FAILED, app, err, load_spec, make_settings


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
    from fedmq.services.cli.embedded import run_job
    from fedmq.services.cli.render import RoundProgress, print_summary

    spec = load_spec(job, rounds, seed)
    settings = make_settings(state_dir=state_dir)
    configure_logging(settings.log_format, "info" if verbose else "warning")
    with RoundProgress(err, enabled=not verbose) as progress:
        result = run_job(spec, settings, learners=learners, on_event=progress.update)
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    print_summary(err if json_out else Console(), result)
    if result["status"] != "completed":
        raise typer.Exit(EXIT_FAILED)
