"""A job's results from anywhere: `model` downloads a global model through the broker, `plot` draws
and exports its metrics (from the scheduler, a local run's state directory, or a JSON file)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.markup import escape

from fedmq.common.errors import ConfigError, FedmqError
from fedmq.common.logging import configure_logging
from fedmq.services.cli.app import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE, app, err, make_settings
from fedmq.services.cli.cluster import _remote_errors
from fedmq.services.cli.history import JobHistory, Which, pick

if TYPE_CHECKING:
    from fedmq.services.cli.remote import Remote


@app.command()
@_remote_errors
def model(
    job_id: Annotated[str, typer.Argument(help="job id printed by submit")],
    out: Annotated[Path | None, typer.Option(
        help="the safetensors file to write [default: JOB_ID.safetensors, JOB_ID-best..., JOB_ID-round-N...]",
    )] = None,
    best: Annotated[bool, typer.Option("--best", help="the objective's best round, not the last")] = False,
    round_: Annotated[int | None, typer.Option("--round", min=0, help="round N's model instead")] = None,
) -> None:
    """Download a job's global model from the aggregator, through the broker, as a safetensors file.

    The last round's by default. The file carries the job spec, as the aggregator's own
    model.safetensors does: load it with fedmq.load_model(path).
    """
    from fedmq.services.cli.remote import Remote

    if best and round_ is not None:
        _fail("--best and --round pick different models: give one of them", EXIT_USAGE)
    which: Which = "best" if best else "final" if round_ is None else round_
    settings = make_settings()
    configure_logging(settings.log_format, "warning")
    with Remote(settings) as remote:
        job, record, path = download(remote, job_id, which, out)
    picked = {"final": " (the last round)", "best": " (the objective's best)"}.get(str(which), "")
    running = "; the job is still running" if job.status == "running" else ""
    err.print(f"round {record['round']} of job {escape(job_id)}{picked} saved to [bold]{escape(str(path))}[/]"
              f"{running}", highlight=False, soft_wrap=True)
    if (job.spec or {}).get("ddp"):  # a DDP job: no Task to build the model with
        err.print("load its tensors with [bold]safetensors.torch.load_file(path)[/]")
    else:
        err.print("load it with [bold]fedmq.load_model(path)[/] (safetensors)")


def download(
    remote: Remote, job_id: str, which: Which, out: Path | None = None
) -> tuple[JobHistory, dict[str, Any], Path]:
    """Fetch `which` model of the job and write it: the job, the round's record and the file; or exit."""
    from fedmq.common.errors import StateUnwritable

    try:
        job, record, weights, spec_json = fetch_model(remote, job_id, which)
    except Unfetchable as exc:
        _fail(str(exc), exc.code)
    path = out or Path(f"{job_id}{suffix(which)}.safetensors")
    try:
        save_fetched(path, job_id, record, weights, spec_json)
    except StateUnwritable as exc:
        _fail(str(exc), EXIT_FAILED)
    return job, record, path


class Unfetchable(FedmqError):
    """A job's model cannot be had; `code` is the exit code `fedmq model` gives it."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def fetch_model(
    remote: Remote, job_id: str, which: Which
) -> tuple[JobHistory, dict[str, Any], dict[str, Any], str]:
    """`which` model of the job from the aggregator: the job, the round's record, the weights and the
    spec to write beside them (canonical JSON); Unfetchable saying why not (the console's too)."""
    from fedmq.common.jobspec import canonical_json, parse_job
    from fedmq.services.cli.remote import AggregatorSilent, ModelUnavailable

    job = job_of(remote, job_id)
    try:
        record = pick(job, which)
    except LookupError as exc:
        raise Unfetchable(str(exc), EXIT_USAGE) from None
    if job.spec is None:
        raise Unfetchable("the scheduler's answer has no job spec to write into the file: upgrade the "
                          "scheduler to this fedmq", EXIT_FAILED)
    try:
        spec = parse_job(dict(job.spec))
    except ConfigError as exc:
        raise Unfetchable(f"this fedmq cannot read the job's spec: {exc}", EXIT_FAILED) from None
    try:
        weights = remote.model(job_id, str(record["model_digest"]))
    except AggregatorSilent as exc:
        raise Unfetchable(str(exc), EXIT_UNREACHABLE) from None
    except ModelUnavailable as exc:
        raise Unfetchable(_unavailable(job_id, int(record["round"]), exc.reason), EXIT_FAILED) from None
    return job, record, weights, canonical_json(spec)


def save_fetched(
    path: Path, job_id: str, record: dict[str, Any], weights: dict[str, Any], spec_json: str
) -> None:
    """A fetched model as `fedmq model` writes it: safetensors, with the spec and the round's metrics."""
    from fedmq.common.checkpoint import save_model

    save_model(path, weights, spec_json, job_id=job_id, round=record["round"],
               metrics=record.get("metrics", {}))


@app.command()
@_remote_errors
def plot(
    job_id: Annotated[str | None, typer.Argument(
        help="job id; with --from or --state-dir, the only (or latest) job there if left out")] = None,
    out: Annotated[Path | None, typer.Option(help="the PNG to write [default: JOB_ID.png]")] = None,
    metric: Annotated[list[str] | None, typer.Option(
        help="a metric to plot, as source.name (repeat it) [default: all but transport.*]")] = None,
    csv_out: Annotated[Path | None, typer.Option("--csv", help="also write the rounds as CSV")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the history as JSON")] = None,
    tensorboard: Annotated[Path | None, typer.Option(
        help="also log every metric per round to TensorBoard in this folder "
        "(pip install 'fedmq\\[tracking]')",
    )] = None,
    from_: Annotated[Path | None, typer.Option(
        "--from", help="read the job from JSON that fedmq wrote (run --json, status JOB --json, plot --json)",
    )] = None,
    state_dir: Annotated[Path | None, typer.Option(
        help="read the job from a local run's state directory (fedmq run's, default .fedmq)")] = None,
) -> None:
    """Plot a job's metrics against rounds to a PNG; export its history as CSV and JSON.

    From the scheduler over the broker, or without one: --state-dir of a `fedmq run`, or --from a
    JSON file.
    """
    from fedmq.services.cli.chart import default_metrics, metrics_figure
    from fedmq.services.cli.history import to_csv

    if from_ is not None and state_dir is not None:
        _fail("--from and --state-dir are two sources: give one of them", EXIT_USAGE)
    if from_ is not None:
        job = _from_file(from_, job_id)
    elif state_dir is not None:
        job = _from_state(state_dir, job_id)
    elif job_id is None:
        _fail("name the job (fedmq status lists them), or read one with --from or --state-dir", EXIT_USAGE)
    else:
        from fedmq.services.cli.remote import Remote

        settings = make_settings()
        configure_logging(settings.log_format, "warning")
        with Remote(settings) as remote:
            job = _job(remote, job_id)
    if not job.records:
        _fail(f"job {job.job_id} has no rounds to plot yet", EXIT_FAILED)
    try:
        figure = metrics_figure(job, metric or default_metrics(job))
    except LookupError as exc:
        _fail(str(exc), EXIT_USAGE)
    png = out or Path(f"{job.job_id or 'metrics'}.png")
    written: list[tuple[Path, Callable[[Path], object]]] = [(png, lambda p: figure.savefig(p, format="png"))]
    if csv_out is not None:
        written.append((csv_out, lambda p: p.write_text(to_csv(job.records))))
    if json_out is not None:
        written.append((json_out, lambda p: p.write_text(json.dumps(job.as_json(), indent=2) + "\n")))
    if tensorboard is not None:
        from fedmq.services.cli.history import to_tensorboard

        try:
            import torch.utils.tensorboard  # noqa: F401 - needs the tensorboard package
        except ImportError:
            _fail("--tensorboard needs the tensorboard package: pip install 'fedmq[tracking]'", EXIT_USAGE)
        written.append((tensorboard, lambda p: to_tensorboard(job, p)))
    for path, write in written:
        try:
            write(path)
        except OSError as exc:
            _fail(f"cannot write {path}: {exc.strerror or exc}", EXIT_FAILED)
        err.print(f"wrote [bold]{path}[/]", highlight=False, soft_wrap=True)


def _job(remote: Remote, job_id: str) -> JobHistory:
    try:
        return job_of(remote, job_id)
    except Unfetchable as exc:
        _fail(str(exc), exc.code)


def job_of(remote: Remote, job_id: str) -> JobHistory:
    """The job's rounds, spec and best from the scheduler; Unfetchable if it has no such job."""
    reply = remote.status("job", job_id)
    if reply.error or not reply.jobs:
        raise Unfetchable(f"{reply.error or f'no job {job_id!r}'}; `fedmq status` lists the jobs", EXIT_USAGE)
    return JobHistory.of(reply.jobs[0])


def _from_file(path: Path, job_id: str | None) -> JobHistory:
    from fedmq.services.cli.history import from_document

    try:
        document = json.loads(path.read_text())
    except OSError as exc:
        _fail(f"cannot read {path}: {exc.strerror or exc}", EXIT_USAGE)
    except ValueError as exc:
        _fail(f"{path} is not JSON: {exc}", EXIT_USAGE)
    try:
        return from_document(document, job_id)
    except ValueError as exc:
        _fail(f"{path}: {exc}", EXIT_USAGE)


def _from_state(state_dir: Path, job_id: str | None) -> JobHistory:
    """A job a `fedmq run` recorded in `state_dir`, its engine's or its scheduler's (`--services`): the
    named one, else the latest."""
    from fedmq.services.cli import pause
    from fedmq.services.engine.journal import StoredJob, stored_jobs
    from fedmq.services.scheduler.jobs import SchedJob

    kept: list[tuple[float, SchedJob | StoredJob]] = [
        (j.accepted_at or 0.0, j) for j in pause.stored_jobs(state_dir)]
    kept += [(j.written_at, j) for j in stored_jobs(state_dir)]
    jobs = [job for _, job in sorted(kept, key=lambda pair: pair[0])]
    if not jobs:
        _fail(f"{state_dir} holds no job: is it the --state-dir the run used?", EXIT_USAGE)
    found = jobs[-1] if job_id is None else next((j for j in jobs if j.job_id == job_id), None)
    if found is None:
        held = ", ".join(j.job_id for j in jobs)
        _fail(f"{state_dir} holds no job {job_id} (jobs there: {held})", EXIT_USAGE)
    objective = None if found.spec.objective is None else found.spec.objective.model_dump()
    return JobHistory(job_id=found.job_id, name=found.spec.name, records=list(found.history),
                      status=found.status, best=found.best, objective=objective)


def _unavailable(job_id: str, server_round: int, reason: str) -> str:
    if reason == "unknown model":
        return (f"the aggregator no longer keeps round {server_round}'s model of job {job_id} "
                "(FEDMQ_KEEP_CHECKPOINTS keeps the last rounds' and the best); download the final or --best")
    if reason == "unknown job":
        return (f"the aggregator holds no job {job_id}: its state directory (FEDMQ_STATE_DIR) is not "
                "the one that trained it")
    return f"the aggregator did not send round {server_round}'s model of job {job_id}: {reason}"


def suffix(which: Which) -> str:
    """What a model file's name adds to the job id: nothing for the final, -best, -round-N."""
    return "" if which == "final" else "-best" if which == "best" else f"-round-{which}"


def _fail(message: str, code: int) -> NoReturn:
    err.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def schema(
    out: Annotated[Path | None, typer.Option(help="write it to this file instead of standard output")] = None,
) -> None:
    """Print the JSON Schema of job spec files, for an editor to complete and check them.

    With the YAML language server (VS Code's YAML extension, for one), a spec's first line
    `# yaml-language-server: $schema=PATH/job.schema.json` points it there, as examples/ do.
    """
    from fedmq.common.specschema import job_schema_text

    text = job_schema_text()
    if out is None:
        typer.echo(text, nl=False)
        return
    out.write_text(text)
    err.print(f"wrote {out}", highlight=False)
