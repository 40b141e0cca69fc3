"""`fedmq gpu-mapping`: a FedML gpu_mapping.yaml (seed 001) as learner environments or compose services."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from fedmq.services.cli.app import EXIT_USAGE, app, err


@app.command("gpu-mapping")
def gpu_mapping(
    mapping_file: Annotated[Path, typer.Argument(help="a FedML-style gpu_mapping.yaml")],
    key: Annotated[str | None, typer.Option(help="which mapping of the file (if it has several)")] = None,
    host: Annotated[str | None, typer.Option(help="only this host's learners")] = None,
    output: Annotated[Literal["env", "json", "compose"], typer.Option(
        "--format", help="env: a shell line per learner; json; compose: services to add to compose.yaml",
    )] = "env",
    compose: Annotated[Path, typer.Option(help="the compose file whose GPU learner they copy")] = Path(
        "compose.yaml"),
    service: Annotated[str, typer.Option(help="that GPU learner service")] = "learner-gpu0",
) -> None:
    """Bind learner replicas to GPUs as a FedML mapping says (host → processes per GPU).

    Each process is a learner: FEDMQ_NODE and FEDMQ_REPLICA name it, CUDA_VISIBLE_DEVICES gives it
    its one GPU and FEDMQ_DEVICE=cuda trains on it. Instead of spreading replicas round-robin.
    """
    import yaml

    from fedmq.common.errors import ConfigError
    from fedmq.common.gpumap import compose_override, placements, read_mapping

    try:
        placed = placements(read_mapping(mapping_file.read_text(), key))
    except OSError as exc:
        err.print(f"[red]error:[/] cannot read {mapping_file}: {exc.strerror or exc}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    except ConfigError as exc:
        err.print(f"[red]error:[/] {mapping_file}: {exc}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    if host is not None:
        hosts = sorted({p.host for p in placed})
        placed = [p for p in placed if p.host == host]
        if not placed:
            err.print(f"[red]error:[/] no host {host!r} in the mapping; it has {hosts}", highlight=False)
            raise typer.Exit(EXIT_USAGE)
    if output == "json":
        rows = [{"host": p.host, "replica": p.replica, "gpu": p.gpu, "env": p.env()} for p in placed]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    elif output == "compose":
        try:
            base = (yaml.safe_load(compose.read_text()) or {}).get("services", {})[service]
        except (OSError, yaml.YAMLError, KeyError, AttributeError) as exc:
            err.print(f"[red]error:[/] no service {service!r} readable in {compose}: {exc}", highlight=False)
            raise typer.Exit(EXIT_USAGE) from None
        sys.stdout.write(yaml.safe_dump(compose_override(placed, base), sort_keys=False))
    else:
        for p in placed:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env().items())
            sys.stdout.write(f"{env} fedmq learner   # {p.host}, GPU {p.gpu}\n")
