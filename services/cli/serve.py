"""`fedmq scheduler|aggregator|learner`: one service as this process, on RabbitMQ."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from fedmq.common.logging import configure_logging
from fedmq.services.cli.app import EXIT_UNREACHABLE, EXIT_USAGE, app, err, make_settings


def _service(name: str, **overrides: Any) -> None:
    from fedmq.common.errors import BrokerUnavailable, ConfigError

    settings = make_settings(**overrides)
    configure_logging(settings.log_format, settings.log_level)
    module = __import__(f"fedmq.services.{name}.app", fromlist=["main"])
    try:
        module.main(settings)
    except BrokerUnavailable as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    except ConfigError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None


@app.command()
def scheduler() -> None:
    """Run the scheduler service (settings from FEDMQ_* environment variables)."""
    _service("scheduler")


@app.command()
def aggregator() -> None:
    """Run the aggregator service."""
    _service("aggregator")


@app.command()
def learner() -> None:
    """Run a learner service (FEDMQ_DEVICE picks its device, FEDMQ_REPLICA its index)."""
    _service("learner")



@app.command()
def console(
    host: Annotated[str | None, typer.Option(
        help="the address to listen on \\[default: FEDMQ_CONSOLE_HOST, 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="the port \\[default: FEDMQ_CONSOLE_PORT, 8080]")] = None,
) -> None:
    """Serve the web console: jobs, rounds, learners and DDP groups; submit, cancel, download.

    It asks the scheduler and the aggregator through the broker, as the CLI does, with its broker user.

    It logs in with FEDMQ_CONSOLE_TOKEN_FILE (or FEDMQ_CONSOLE_TOKEN) and has no default password.

    Needs the console extra: pip install 'fedmq\\[console]' (docs/console.md).
    """
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        err.print("[red]error:[/] the console needs its web libraries: pip install 'fedmq\\[console]'",
                  highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    _service("console", console_host=host, console_port=port)
