"""The `fedmq` Typer app and what its commands share: spec loading, settings, exit codes."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError as PydanticValidationError
from rich.console import Console
from typer.core import TyperGroup

from fedmq.common.allowlist import AllowList
from fedmq.common.errors import ConfigError, SetupError
from fedmq.common.jobspec import JobSpec, load_job
from fedmq.common.settings import Settings


class Group(TyperGroup):
    """The `fedmq` group: a flag's help shows no value type (typer 0.29's rich help writes
    `--json <bool>`, as if the flag took a value), for its own options and every command's."""

    def get_params(self, ctx: Any) -> list[Any]:  # click.Context: typer 0.29 vendors its own click
        return _untyped_flags(super().get_params(ctx))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _untyped_flags(command.get_params(ctx))  # --help included: a command keeps the one it made
        return command


def _untyped_flags(params: list[Any]) -> list[Any]:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # what help shows in the type column; a flag parses no value
    return params


app = typer.Typer(
    cls=Group,
    name="fedmq",
    help="Federated learning over RabbitMQ: run, submit and watch jobs, or start a service.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

EXIT_FAILED, EXIT_USAGE = 1, 2
EXIT_UNREACHABLE = 3
# FEDMQ_ variables of scripts/ and tests/ (make test, the tests' broker), no service's
NOT_SETTINGS = ("FEDMQ_NO_INSTALL", "FEDMQ_TEST_BROKER_URL")


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
    broker_url: Annotated[str | None, typer.Option(
        "--broker-url", help="the broker, amqp://user@host:5672/vhost (sets FEDMQ_BROKER_URL)",
    )] = None,
) -> None:
    """Federated learning over RabbitMQ."""
    if broker_url is not None:
        os.environ["FEDMQ_BROKER_URL"] = broker_url
    # A user's plug-ins (`my_pkg.mod:build`) live beside their job spec, as with uvicorn.
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")


def load_spec(job: Path, rounds: int | None, seed: int | None, settings: Settings) -> JobSpec:
    """The job spec with the command line's overrides; exit 2 with the reason if it is invalid."""
    try:
        return check_spec(job, settings, rounds=rounds, seed=seed)
    except ConfigError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        if not isinstance(exc, SetupError):  # the spec's own text is at fault, not a file or module
            err.print("Fix the job spec and run again; see examples/ for valid specs.")
        raise typer.Exit(EXIT_USAGE) from None


def check_spec(
    job: Path, settings: Settings, *, rounds: int | None = None, seed: int | None = None,
    project: Path | None = None,
) -> JobSpec:
    """`fedmq submit`'s checks of a job spec file, the console's too; ConfigError saying what is wrong.

    Its Task and strategy are imported here to check their options: from fedmq's built-ins,
    FEDMQ_ALLOWED_CODE's prefixes, or the user's project (allowlist.AllowList.project): the folder
    around the spec, or `project`.
    """
    overrides: dict[str, Any] = {}
    if rounds is not None:
        overrides["rounds"] = rounds
    if seed is not None:
        overrides["seed"] = seed
    spec = load_job(job, overrides)
    from fedmq.common.jobcheck import complete_spec  # imports the Task: after the cheap checks

    allowed = (project_code(settings, job) if project is None
               else AllowList.project(settings.allowed_prefixes, spec_dir=project))
    spec = complete_spec(spec, allowed)
    check_task(spec, allowed)
    return spec


def check_task(spec: JobSpec, allowed: AllowList) -> None:
    """The Task's own check of the job (`Task.check_job`: more clients than samples); ConfigError."""
    from fedmq.common.allowlist import allowing
    from fedmq.common.task.contract import DataContext, has_train
    from fedmq.common.task.loading import make_task

    name = spec.task.name
    task = make_task(name, spec.task.options, allowed)
    if spec.train.dp_sgd is not None and has_train(task):
        raise ConfigError(
            f"task {name!r} defines its own train(), and train.dp_sgd is fedmq's loop's: define loss() "
            "instead, or remove train.dp_sgd"
        )
    if spec.personalize is not None and has_train(task):
        raise ConfigError(
            f"task {name!r} defines its own train(), and personalize is fedmq's loop's: define loss() "
            "instead, or remove personalize"
        )
    if spec.personalize is not None and spec.personalize.method == "fedper":
        from fedmq.common.task.contract import Personal
        from fedmq.common.task.layers import own_layers
        from fedmq.common.task.runtime import TaskRuntime

        personal = Personal.from_spec(spec.personalize)
        assert personal is not None
        try:
            with allowing(allowed):
                own_layers(TaskRuntime(spec, task).build_model(), personal)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    try:
        with allowing(allowed):
            task.check_job(DataContext(client=-1, num_clients=spec.clients.total, seed=spec.seed))
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"task {name!r} cannot run this job: {exc}") from None
    except Exception as exc:
        raise ConfigError(f"task {name!r}: check_job raised {type(exc).__name__}: {exc}") from None


def project_code(settings: Settings, job: Path) -> AllowList:
    """What this process may import for a job: the services' list, and the project around the spec."""
    return AllowList.project(settings.allowed_prefixes, spec_dir=job.resolve().parent)


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """A line for each FEDMQ_ variable that is no setting (a typo is otherwise silently ignored)."""
    import difflib

    known = [f"FEDMQ_{name.upper()}" for name in Settings.model_fields] + list(NOT_SETTINGS)
    lines = []
    for name in sorted(k for k in environ if k.startswith("FEDMQ_") and k not in known):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        lines.append(f"{name} is not a fedmq setting" + (f": did you mean {close[0]}?" if close else ""))
    return lines


def make_settings(**overrides: Any) -> Settings:
    """Settings from the environment and the given options; exit 2 naming a bad one."""
    for line in unknown_settings(os.environ):
        err.print(f"[yellow]warning:[/] {line} (docs/configuration.md)", highlight=False)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except PydanticValidationError as exc:
        for e in exc.errors():  # the settings hide their input: no password is printed
            field = ".".join(str(p) for p in e["loc"])
            where = f"setting FEDMQ_{field.upper()}: " if field else ""  # a check across settings names them
            message = e["msg"].removeprefix("Value error, ")
            err.print(f"[red]error:[/] {where}{message}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
