"""The `fedmq` command line: the app, with its commands registered by group.

`fedmq --help` lists commands in the order they register, hence the import order below.
"""

from __future__ import annotations

from fedmq.services.cli.app import app

# isort: off
from fedmq.services.cli import local  # noqa: F401,E402 - run
from fedmq.services.cli import serve  # noqa: F401,E402 - scheduler, aggregator, learner
from fedmq.services.cli import cluster  # noqa: F401,E402 - submit, watch, status, cancel, learners
from fedmq.services.cli import placement  # noqa: F401,E402 - gpu-mapping
from fedmq.services.cli import results  # noqa: F401,E402 - model, plot
# isort: on

__all__ = ["app"]


if __name__ == "__main__":
    app()
