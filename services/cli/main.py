"""The `fedmq` command line."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError as PydanticValidationError
from rich.console import Console

from common.errors import ConfigError
from common.jobspec import JobSpec, load_job
from common.logging import configure_logging
from common.messages import JobSubmit, to_wire
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


def new_job_id(spec: JobSpec) -> str:
    return f"{spec.name}-{uuid.uuid4().hex[:8]}"


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
    from services.cli.embedded import EmbeddedCluster
    from services.cli.follow import JobFollower
    from services.cli.render import RoundProgress, print_summary, summarize

    spec = _load(job, rounds, seed)
    settings = _settings(state_dir=state_dir)
    configure_logging(settings.log_format, "info" if verbose else "warning")
    job_id = new_job_id(spec)
    history: list[dict[str, Any]] = []
    final: dict[str, Any] = {}
    started = time.perf_counter()
    with EmbeddedCluster(settings, learners=learners) as cluster:
        follower = JobFollower(cluster.connect(), job_id).start()
        submit = JobSubmit(job_id=job_id, spec=spec.model_dump(mode="json"))
        follower.bus.publish("fedmq.scheduler", to_wire(submit))
        with RoundProgress(err, enabled=not verbose) as progress:
            for event in follower.events():
                progress.update(event)
                if event.kind == "round_completed":
                    history.append(dict(event.data))
                elif event.kind in ("completed", "failed", "cancelled"):
                    final = {"status": event.kind, **event.data}
        follower.close()
    result = {
        "job_id": job_id,
        "name": spec.name,
        "wall_seconds": time.perf_counter() - started,
        **final,
        **summarize(history),
        "history": history,
    }
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    print_summary(err if json_out else Console(), result)
    if result["status"] != "completed":
        raise typer.Exit(EXIT_FAILED)


if __name__ == "__main__":
    app()
