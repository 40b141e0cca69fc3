"""`fedmq scheduler|aggregator|learner`: one service as this process, on RabbitMQ."""

from __future__ import annotations

import typer

from fedmq.common.logging import configure_logging
from fedmq.services.cli.app import EXIT_UNREACHABLE, EXIT_USAGE, app, err, make_settings


def _service(name: str) -> None:
    from fedmq.common.errors import BrokerUnavailable, ConfigError

    settings = make_settings()
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


