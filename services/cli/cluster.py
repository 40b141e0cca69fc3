"""Commands for a cluster on RabbitMQ: submit, watch, status, cancel, learners."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from fedmq.common.logging import configure_logging
from fedmq.services.cli.app import (
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    app,
    err,
    load_spec,
    make_settings,
)
from fedmq.services.cli.interrupt import EXIT_INTERRUPTED

WATCH_POLL_S = 15.0  # with no event for this long, `watch` asks the scheduler directly


def _remote_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Broker and scheduler trouble, and Ctrl-C, are one clear line and an exit code, never a traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from fedmq.common.errors import BrokerUnavailable, ConfigError
        from fedmq.services.cli.remote import SchedulerSilent

        with _on_interrupt(lambda: "interrupted"):
            try:
                return fn(*args, **kwargs)
            except (BrokerUnavailable, SchedulerSilent) as exc:
                err.print(f"[red]error:[/] {exc}", highlight=False)
                raise typer.Exit(EXIT_UNREACHABLE) from None
            except ConfigError as exc:  # the settings cannot reach a broker (memory://)
                err.print(f"[red]error:[/] {exc}", highlight=False)
                raise typer.Exit(EXIT_USAGE) from None

    return wrapper


@contextmanager
def _on_interrupt(say: Callable[[], str]) -> Iterator[None]:
    """Ctrl-C: one line saying where things stand, and exit 130 as `fedmq run` (whatever typer does)."""
    try:
        yield
    except KeyboardInterrupt:
        err.print(say(), highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


@app.command()
@_remote_errors
def submit(
    job: Annotated[Path, typer.Argument(help="job spec (YAML)")],
    rounds: Annotated[int | None, typer.Option(help="override the spec's rounds")] = None,
    seed: Annotated[int | None, typer.Option(help="override the spec's seed")] = None,
    watch_: Annotated[bool, typer.Option("--watch", help="follow the job until it ends")] = False,
) -> None:
    """Validate a job spec here, then hand it to the scheduler; prints the job id."""
    settings = make_settings()
    spec = load_spec(job, rounds, seed, settings)
    from fedmq.services.cli.embedded import new_job_id  # imports torch: after the spec's checks
    from fedmq.services.cli.remote import Remote

    configure_logging(settings.log_format, "warning")
    job_id = new_job_id(spec)
    sent = False

    def said() -> str:
        if sent:
            return f"interrupted: job {job_id} was submitted; follow it with: fedmq watch {job_id}"
        return f"interrupted before the broker confirmed job {job_id}; `fedmq status` shows whether it has it"

    with _on_interrupt(said), Remote(settings) as remote:
        warning = remote.submit(spec, job_id)
        sent = True
    typer.echo(job_id)
    if warning:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    if watch_:
        watch(job_id)
    else:
        err.print(f"submitted; follow it with: fedmq watch {job_id}")


@app.command()
@_remote_errors
def watch(
    job_id: Annotated[str, typer.Argument(help="job id printed by submit")],
    json_out: Annotated[bool, typer.Option("--json", help="print the final result as JSON")] = False,
) -> None:
    """Follow a job round by round; exit 0 when it completes, 1 when it fails or is cancelled."""
    from fedmq.services.cli.follow import TERMINAL
    from fedmq.services.cli.remote import Remote
    from fedmq.services.cli.render import RoundProgress
    from fedmq.services.cli.summary import summarize

    settings = make_settings()
    configure_logging(settings.log_format, "warning")
    stopped = f"stopped watching; job {job_id} goes on (`fedmq cancel {job_id}` stops it)"
    with _on_interrupt(lambda: stopped), Remote(settings) as remote:
        follower = remote.follow(job_id)  # subscribe first, then catch up: no event is missed
        reply = remote.status("job", job_id)
        if reply.error:
            err.print(f"[red]error:[/] {reply.error}; `fedmq status` lists the jobs", highlight=False)
            raise typer.Exit(EXIT_USAGE)
        job = reply.jobs[0]
        history = {h["round"]: h for h in job.get("history", [])}
        # A job that already ended is described by the status reply alone.
        final: dict[str, Any] = {
            k: job.get(k) for k in ("status", "reason", "model_path", "best", "wall_seconds")
            if job.get(k) is not None
        }
        if final.get("status") == "running":
            final = {}
        if job["status"] == "running":
            with RoundProgress(err) as progress:
                progress.start_job(job["name"], job["rounds"], history.values(), _objective(job),
                                   job.get("report"))
                while final.get("status") not in TERMINAL:
                    try:
                        for event in follower.events(idle_timeout=WATCH_POLL_S):
                            progress.update(event)
                            if event.kind == "round_completed" and event.round is not None:
                                history[event.round] = dict(event.data)
                            elif event.kind in TERMINAL:
                                final = {"status": event.kind, **event.data}
                    except TimeoutError:
                        # Quiet for a while: events are best effort (a reconnect loses some), so
                        # ask the scheduler how things stand, as a watcher arriving late would.
                        job = remote.status("job", job_id).jobs[0]
                        history.update({h["round"]: h for h in job.get("history", [])})
                        progress.start_job(job["name"], job["rounds"], history.values(), _objective(job),
                                           job.get("report"))
                        if job["status"] != "running":
                            final = {k: job.get(k) for k in ("status", "reason", "model_path", "best",
                                                             "wall_seconds") if job.get(k) is not None}
    rounds = [history[r] for r in sorted(history)]
    result = {"job_id": job_id, "name": job["name"], **final, **summarize(rounds, job.get("objective")),
              "history": rounds, "ddp": bool((job.get("spec") or {}).get("ddp"))}
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    from fedmq.services.cli.render import print_summary

    # From the job's acceptance to its end, as the scheduler timed it (older schedulers: the rounds').
    print_summary(err, {"wall_seconds": sum(r.get("seconds", 0.0) for r in rounds), **result})
    if result["status"] != "completed":
        raise typer.Exit(EXIT_FAILED)


@app.command()
@_remote_errors
def status(
    job_id: Annotated[str | None, typer.Argument(help="one job's rounds; all jobs if left out")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """A table of jobs, or one job's rounds."""

    from fedmq.services.cli.remote import Remote, jobs_table, rounds_table

    settings = make_settings()
    configure_logging(settings.log_format, "warning")
    with Remote(settings) as remote:
        reply = remote.status("job" if job_id else "jobs", job_id or "")
    if reply.error:
        err.print(f"[red]error:[/] {reply.error}", highlight=False)
        raise typer.Exit(EXIT_USAGE)
    if json_out:
        sys.stdout.write(json.dumps(reply.jobs, indent=2) + "\n")
        return
    console = Console()
    fleet = reply.fleet
    if fleet:
        lost = fleet["lost"]
        gone = f", [red]{len(lost)} lost[/] ({', '.join(lost[:5])})" if lost else ""
        console.print(f"learners: {fleet['alive']} alive, {fleet['busy']} busy{gone}")
    console.print(jobs_table(reply.jobs))
    if job_id and reply.jobs:
        job = reply.jobs[0]
        if job.get("reason"):
            console.print(f"reason: {job['reason']}", markup=False, highlight=False)  # the table cuts it
        if "reported" in job:
            console.print(
                f"round {job['round']}: {job['reported']}/{job['sampled']} clients reported, "
                f"{job['failed_clients']} failed, deadline in {job['deadline_in_s']} s, "
                f"{job['retries_left']} retries left"
            )
        console.print(rounds_table(job.get("history", [])))


@app.command()
@_remote_errors
def cancel(job_id: Annotated[str, typer.Argument(help="job id")]) -> None:
    """Stop a running job; its checkpoints stay on disk."""
    from fedmq.services.cli.remote import Remote, UnknownJob

    settings = make_settings()
    configure_logging(settings.log_format, "warning")
    with Remote(settings) as remote:
        try:
            not_sent = remote.cancel(job_id)
        except UnknownJob as exc:
            err.print(f"[red]error:[/] {exc}; `fedmq status` lists the jobs", highlight=False)
            raise typer.Exit(EXIT_USAGE) from None
    if not_sent:
        err.print(not_sent, highlight=False)
        return
    err.print(f"cancel requested for {job_id}", highlight=False)


@app.command()
@_remote_errors
def learners(json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
    """The learners the scheduler knows: device, busy or idle, sites, ranks and last heartbeat."""
    from rich.table import Table

    from fedmq.services.cli.remote import Remote

    settings = make_settings()
    configure_logging(settings.log_format, "warning")
    with Remote(settings) as remote:
        reply = remote.status("learners")
    if json_out:
        sys.stdout.write(json.dumps(reply.learners, indent=2) + "\n")
        return
    table = Table(
        "learner", "device", "state", "sites", "DDP group", "rank", "local", "node", "world", "last seen"
    )
    for row in reply.learners:
        state = ("busy" if row["busy"] else "idle") if row["alive"] else "[red]lost[/]"
        table.add_row(
            row["learner"], row["device"], state, ",".join(row.get("sites") or []) or "-",
            row.get("group") or "-",
            *(str(row.get(k, "-")) for k in
            ("rank", "local_rank", "node_rank", "world_size")), f"{row['age_s']:.1f}s ago",
        )
    Console().print(table)


def _objective(job: dict[str, Any]) -> str | None:
    return (job.get("objective") or {}).get("metric")
