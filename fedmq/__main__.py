"""`python -m fedmq` is the `fedmq` command."""

from fedmq.services.cli.main import app

app(prog_name="fedmq")
