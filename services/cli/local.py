"""`fedmq run`: a whole job in this process; Ctrl-C stops it after a checkpoint, --resume goes on.

By default the in-process engine runs it (services/engine): one loop, no bus. `--services` runs
the scheduler, aggregator and learners as threads on the in-memory bus instead, as deployed.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from fedmq.common.errors import ConfigError, StateUnwritable
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
    learners: Annotated[int, typer.Option(min=1, help="learner threads (with --services)")] = 1,
    resume: Annotated[str | None, typer.Option(
        metavar="JOB_ID", help="go on with a job Ctrl-C stopped (same spec, same --state-dir)"
    )] = None,
    services: Annotated[bool, typer.Option(
        "--services", help="run the scheduler, aggregator and learners as threads on an in-memory bus, "
        "as deployed, instead of the in-process engine (same results, slower rounds)",
    )] = False,
    checkpoint_every: Annotated[int | None, typer.Option(
        min=1, help="rounds between checkpoints [default: FEDMQ_CHECKPOINT_EVERY, 10]",
    )] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the per-round history as JSON")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="show service logs, and the traceback of user code that failed")] = False,
) -> None:
    """Train a job in this process (no broker needed)."""
    settings = make_settings(state_dir=state_dir)
    if checkpoint_every is not None:
        settings = settings.model_copy(update={"checkpoint_every": checkpoint_every})
    spec = load_spec(job, rounds, seed, settings)
    if spec.ddp is not None:
        services = True  # a DDP job has no rounds for the engine: its ranks run on the services' learners
    # The services import torch (seconds): only once the spec is known to be good.
    from fedmq.services.cli.embedded import new_job_id
    from fedmq.services.cli.interrupt import ENGINE_STOPPING, EXIT_INTERRUPTED, SERVICES_STOPPING, Interrupt
    from fedmq.services.cli.render import RoundProgress, print_summary

    configure_logging(settings.log_format, "info" if verbose else "warning")
    if learners > 1 and not services:
        err.print("note: --learners takes effect with --services; the engine trains in this thread",
                  highlight=False)
    _check_state(settings.state_dir, spec, job, resume, services)
    if spec.train.dp_sgd is not None and settings.dp_key is None:
        err.print("note: train.dp_sgd's noise comes from a random key, so this run will not repeat bit for "
                  "bit; set FEDMQ_DP_KEY (a secret) for one that does", highlight=False)
    job_id = resume or new_job_id(spec)
    again = shlex.join([
        "fedmq", "run", str(job), *(["--rounds", str(rounds)] if rounds is not None else []),
        *(["--seed", str(seed)] if seed is not None else []),
        "--resume", job_id, "--state-dir", str(settings.state_dir), *(["--services"] if services else []),
    ])
    allowed = project_code(settings, job)
    try:
        stopping = SERVICES_STOPPING if services else ENGINE_STOPPING
        with Interrupt(f"Resume with: {again}", stopping) as interrupt, \
                RoundProgress(err, enabled=not verbose) as progress:
            if services:
                from fedmq.services.cli.embedded import run_job

                result = run_job(spec, settings, learners=learners, job_id=job_id, resume=resume is not None,
                                 on_event=progress.update, interrupt=interrupt, allowed=allowed)
            else:
                from fedmq.services.engine.run import run_job as run_engine

                result = run_engine(spec, settings, job_id=job_id, resume=resume is not None,
                                    on_event=progress.update, on_notice=progress.say,
                                    on_engine=interrupt.attach, allowed=allowed)
                if result["status"] == "stopped":
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        _say_stopped(settings.state_dir, job_id, spec, again, services)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except ConfigError as exc:  # a setting only the services check, such as FEDMQ_DEVICE
        _refuse(str(exc))
    except (StateUnwritable, OSError) as exc:  # the engine's checkpoint: the job resumes from the last
        err.print(f"error: the state directory {settings.state_dir} could not be written ({exc}); free "
                  f"some space or fix its rights, then resume: {again}",
                  highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_FAILED) from None
    if result["status"] == "completed":
        _save_best(_jobs_root(settings.state_dir, services), job_id, spec, result)
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    print_summary(err if json_out else Console(), result)
    if verbose and (trace := (result.get("error") or {}).get("trace")):  # where the user's code raised
        err.print(trace, highlight=False, markup=False, soft_wrap=True, end="")
    if result["status"] != "completed":
        raise typer.Exit(EXIT_FAILED)


def _jobs_root(state_dir: Path, services: bool) -> Path:
    """Where a local run keeps its jobs' models: the aggregator's folder, or the engine's."""
    return Path(state_dir) / ("aggregator" if services else "engine")


def _save_best(root: Path, job_id: str, spec: JobSpec, result: dict[str, Any]) -> None:
    """The objective's best round as a model file beside the final one (`best_model_path`)."""
    from fedmq.common.checkpoint import save_model
    from fedmq.services.aggregator.store import JobStore

    best = result.get("best")
    if not best:
        return
    store = JobStore(root, job_id)
    weights = store.load_weights(str(best["model_digest"]))
    rounds = {h["round"]: h for h in result.get("history", [])}
    metrics: dict[str, Any] = rounds.get(best["round"], {}).get("metrics", {})
    path = save_model(
        store.root / "best.safetensors", weights, canonical_json(spec),
        job_id=job_id, round=best["round"], metrics=metrics,
    )
    result["best_model_path"] = str(path)


def _say_stopped(state_dir: Path, job_id: str, spec: JobSpec, again: str, services: bool) -> None:
    """After Ctrl-C: where the job stopped, and how to go on or start over."""
    from fedmq.services.cli import pause

    stopped = next((j for j in _stored(state_dir, services) if j.job_id == job_id), None)
    if stopped is None:  # stopped before the job began: nothing of it to resume
        if services:
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


def _stored(state_dir: Path, services: bool) -> list[Any]:
    """The jobs a local run left in `state_dir` (job_id, spec, status, round): the services' or engine's."""
    if services:
        from fedmq.services.cli import pause

        return list(pause.stored_jobs(state_dir))
    from fedmq.services.engine.journal import stored_jobs

    return list(stored_jobs(state_dir))


def _check_state(state_dir: Path, spec: JobSpec, job: Path, resume: str | None, services: bool) -> None:
    """A new job only in a state directory with no unfinished one; a resumed one as it began."""
    jobs = _stored(state_dir, services)
    if resume is None:
        for stopped in (j for j in jobs if j.status == "running" and services):
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
    if not services and found.status != "running":
        _refuse(f"job {resume} has {found.status}: there is nothing to resume (`fedmq plot --state-dir "
                f"{state_dir} {resume}` shows its rounds)")
    if not services and found.round < 0:
        _refuse(f"job {resume} stopped before its first checkpoint: start it again, without --resume")
    if canonical_json(found.spec) != canonical_json(spec):
        _refuse(f"job {resume} was started from another spec: resume it with the same job spec, "
                "--rounds and --seed as it began")


def _refuse(message: str) -> NoReturn:
    err.print(f"error: {message}", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(EXIT_USAGE)
