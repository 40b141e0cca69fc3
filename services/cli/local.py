"""`fedmq run`: a whole job in this process, on the in-memory bus; Ctrl-C pauses it, --resume goes on."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import JobSpec, canonical_json
from fedmq.common.logging import configure_logging
from fedmq.services.cli.app import (
    EXIT_FAILED,
    EXIT_USAGE,
    app,
    err,
    load_spec,
    make_settings,
    project_code,
)


@app.command()
def run(
    job: Annotated[Path, typer.Argument(help="job spec (YAML)")],
    state_dir: Annotated[Path | None, typer.Option(help="where checkpoints and the model go")] = None,
    rounds: Annotated[int | None, typer.Option(help="override the spec's rounds")] = None,
    seed: Annotated[int | None, typer.Option(help="override the spec's seed")] = None,
    learners: Annotated[int, typer.Option(min=1, help="learner threads")] = 1,
    resume: Annotated[str | None, typer.Option(
        metavar="JOB_ID", help="go on with a job Ctrl-C stopped (same spec, same --state-dir)"
    )] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the per-round history as JSON")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show service logs")] = False,
) -> None:
    """Train a job in this process on the in-memory bus (no broker needed)."""
    settings = make_settings(state_dir=state_dir)
    spec = load_spec(job, rounds, seed, settings)
    # The services import torch (seconds): only once the spec is known to be good.
    from fedmq.services.cli.embedded import new_job_id, run_job
    from fedmq.services.cli.interrupt import EXIT_INTERRUPTED, Interrupt
    from fedmq.services.cli.render import RoundProgress, print_summary

    configure_logging(settings.log_format, "info" if verbose else "warning")
    _check_state(settings.state_dir, spec, job, resume)
    if spec.train.dp_sgd is not None and settings.dp_key is None:
        err.print("note: train.dp_sgd's noise comes from a random key, so this run will not repeat bit for "
                  "bit; set FEDMQ_DP_KEY (a secret) for one that does", highlight=False)
    job_id = resume or new_job_id(spec)
    again = shlex.join([
        "fedmq", "run", str(job), *(["--rounds", str(rounds)] if rounds is not None else []),
        *(["--seed", str(seed)] if seed is not None else []),
        "--resume", job_id, "--state-dir", str(settings.state_dir),
    ])
    try:
        with Interrupt(f"Resume with: {again}") as interrupt, \
                RoundProgress(err, enabled=not verbose) as progress:
            result = run_job(spec, settings, learners=learners, job_id=job_id, resume=resume is not None,
                             on_event=progress.update, interrupt=interrupt,
                             allowed=project_code(settings, job))
    except KeyboardInterrupt:
        _say_stopped(settings.state_dir, job_id, spec, again)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except ConfigError as exc:  # a setting only the services check, such as FEDMQ_DEVICE
        _refuse(str(exc))
    if result["status"] == "completed":
        _save_best(settings.state_dir, job_id, spec, result)
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    print_summary(err if json_out else Console(), result)
    if result["status"] != "completed":
        raise typer.Exit(EXIT_FAILED)


def _save_best(state_dir: Path, job_id: str, spec: JobSpec, result: dict[str, Any]) -> None:
    """The objective's best round as a model file beside the final one (`best_model_path`)."""
    from fedmq.common.checkpoint import save_model
    from fedmq.services.aggregator.store import JobStore

    best = result.get("best")
    if not best:
        return
    store = JobStore(Path(state_dir) / "aggregator", job_id)
    weights = store.load_weights(str(best["model_digest"]))
    rounds = {h["round"]: h for h in result.get("history", [])}
    metrics: dict[str, Any] = rounds.get(best["round"], {}).get("metrics", {})
    path = save_model(
        store.root / "best.safetensors", weights, canonical_json(spec),
        job_id=job_id, round=best["round"], metrics=metrics,
    )
    result["best_model_path"] = str(path)


def _say_stopped(state_dir: Path, job_id: str, spec: JobSpec, again: str) -> None:
    """After Ctrl-C: where the job stopped, and how to go on or start over."""
    from fedmq.services.cli import pause

    stopped = next((j for j in pause.stored_jobs(state_dir) if j.job_id == job_id), None)
    if stopped is None:  # stopped before the scheduler took the job: nothing of it to resume
        pause.discard(state_dir)
        err.print(f"interrupted before job {job_id} began; start it again", highlight=False)
        return
    where = f"stopped in round {stopped.round} of {spec.rounds}"
    if stopped.round == 0:
        where = "stopped before round 1"
    if stopped.status != "running":
        where = f"had {stopped.status}"
    err.print(
        f"interrupted: job {job_id} {where}; its state is kept in {state_dir}\n"
        f"  resume it:   {again}\n"
        f"  start over:  delete {state_dir}, or run with another --state-dir",
        highlight=False, markup=False, soft_wrap=True,
    )


def _check_state(state_dir: Path, spec: JobSpec, job: Path, resume: str | None) -> None:
    """A new job only in a state directory with no unfinished one; a resumed one as it began."""
    from fedmq.services.cli import pause

    jobs = pause.stored_jobs(state_dir)
    if resume is None:
        for stopped in (j for j in jobs if j.status == "running"):
            again = shlex.join(["fedmq", "run", str(job), "--resume", stopped.job_id,
                                "--state-dir", str(state_dir)])
            _refuse(
                f"{state_dir} holds job {stopped.job_id}, stopped in round {stopped.round} of "
                f"{stopped.spec.rounds} (its services would go on with it beside a new job)\n"
                f"  resume it:   {again}\n"
                f"  start over:  delete {state_dir}, or run with another --state-dir"
            )
        return
    found = next((j for j in jobs if j.job_id == resume), None)
    if found is None:
        known = ", ".join(j.job_id for j in jobs) or "none"
        _refuse(f"{state_dir} holds no job {resume} (jobs there: {known}); is --state-dir the same?")
    if canonical_json(found.spec) != canonical_json(spec):
        _refuse(f"job {resume} was started from another spec: resume it with the same job spec, "
                "--rounds and --seed as it began")


def _refuse(message: str) -> NoReturn:
    err.print(f"error: {message}", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(EXIT_USAGE)
