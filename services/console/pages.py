"""What the console's pages show, as plain data from the scheduler's and aggregator's answers.

Nothing here renders HTML: the templates do, with Jinja's autoescaping, so no text a job, a learner
or a spec carries is ever taken for markup.
"""

from __future__ import annotations

import io
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import JobSpec
from fedmq.common.settings import Settings
from fedmq.services.cli.history import JobHistory, Which
from fedmq.services.cli.remote import number_cell

FAILURES_SHOWN = 50
PLACED = 200  # a spec's problems placed on their lines; past these, listed above the spec
LISTED = 50  # problems listed above the spec, the rest counted
_FIELD = re.compile(r"^\s*- ([^:\s]+): (.*)$")
_YAML_LINE = re.compile(r"line (\d+)")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec, and the line of the spec it is about (None: the whole spec)."""

    line: int | None
    message: str


def check_text(text: str, settings: Settings, project: Path) -> tuple[JobSpec | None, list[Problem]]:
    """`fedmq submit`'s checks of a pasted spec: the spec, or the problems by line.

    The text is checked as a file in a folder of its own, with `project` as the folder whose code
    the spec may name (the console's working directory: what `fedmq submit` run there allows).
    """
    from fedmq.services.cli.app import check_spec

    with tempfile.TemporaryDirectory(prefix="fedmq-console-") as folder:
        path = Path(folder) / "job.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            return check_spec(path, settings, project=project), []
        except ConfigError as exc:
            return None, problems(str(exc).replace(str(path), "the spec"), text)


def problems(message: str, text: str) -> list[Problem]:
    """A ConfigError's lines, each placed on the spec line it names: a field's ("- train.lr: ..."), or
    the line a YAML error gives; the rest are about the whole spec. The spec is parsed once, and only
    the first PLACED problems are placed (a spec may hold thousands of unknown keys)."""
    found: list[Problem] = []
    head: list[str] = []
    lines: dict[str, int] | None = None
    for raw in message.splitlines():
        field = _FIELD.match(raw)
        if field:
            if lines is None:
                lines = key_lines(text)
            where = nearest(lines, field.group(1)) if len(found) < PLACED else None
            found.append(Problem(where,
                                 f"{field.group(1)}: {field.group(2)}"))
        elif raw.strip():
            head.append(raw.strip())
    if head and found and len(head) == 1 and head[0].endswith("is invalid:"):
        placed = sum(p.line is not None for p in found)
        head = [f"the spec has {len(found)} problem{'s' if len(found) > 1 else ''}"
                + (", shown beside their lines" if placed == len(found) else "")]
    if head:
        yaml_line = _YAML_LINE.search(" ".join(head)) if "YAML" in head[0] else None
        found.insert(0, Problem(int(yaml_line.group(1)) if yaml_line else None, " ".join(head)))
    return found


def key_lines(text: str) -> dict[str, int]:
    """The 1-based line of every key and list item of a YAML document, by dotted path (a.b.0.c);
    {} if it does not parse. One walk, no recursion."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}
    todo: list[tuple[str, Any]] = [("", root)]
    while todo:
        path, node = todo.pop()
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    child = f"{path}.{key.value}" if path else str(key.value)
                    lines.setdefault(child, key.start_mark.line + 1)
                    todo.append((child, value))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                child = f"{path}.{index}" if path else str(index)
                lines.setdefault(child, item.start_mark.line + 1)
                todo.append((child, item))
    return lines


def nearest(lines: dict[str, int], dotted: str) -> int | None:
    """The line of `dotted`, else of its nearest parent the document has."""
    parts = dotted.split(".")
    while parts:
        line = lines.get(".".join(parts))
        if line is not None:
            return line
        parts.pop()
    return None


def listed(found: list[Problem]) -> list[str]:
    """The problems about no line, as the page lists them above the spec: the first LISTED, then a count."""
    loose = [p.message for p in found if p.line is None]
    if len(loose) <= LISTED:
        return loose
    return [*loose[:LISTED], f"... and {len(loose) - LISTED} more"]


def annotated_lines(text: str, found: list[Problem]) -> list[tuple[int, str, list[str]]]:
    """The spec's lines, numbered, each with the problems about it (shown beneath it)."""
    by_line: dict[int, list[str]] = {}
    for problem in found:
        if problem.line is not None:
            by_line.setdefault(problem.line, []).append(problem.message)
    return [(n, line, by_line.get(n, [])) for n, line in enumerate(text.splitlines(), start=1)]


def failures(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's failed clients, newest round first: round, client, phase, reason."""
    rows = [{"round": record["round"], **failure}
            for record in reversed(job.get("history") or []) for failure in record.get("failures") or []]
    return rows[:FAILURES_SHOWN]


def chart_png(job: dict[str, Any]) -> bytes | None:
    """`fedmq plot`'s figure of the job, as PNG; None before its first round."""
    from fedmq.services.cli.chart import default_metrics, metrics_figure

    try:
        history = JobHistory.of(job)
    except ValueError:  # no rounds list: a scheduler older than the console
        return None
    if not history.records:
        return None
    figure = metrics_figure(history, default_metrics(history))
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()


def which_model(value: str) -> Which:
    """final, best or a round number, from a download link; ValueError otherwise."""
    if value in ("final", "best"):
        return value  # type: ignore[return-value]
    if value.isdigit():
        return int(value)
    raise ValueError(f"which model: final, best or a round number, not {value[:20]!r}")


def file_name(job_id: str, which: Which) -> str:
    """The download's file name, as `fedmq model` names it; only [A-Za-z0-9_.-] (a header's value)."""
    from fedmq.services.cli.results import suffix

    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{job_id}{suffix(which)}") + ".safetensors"


def number(value: Any) -> str:
    """A metric as the pages show it: as the CLI's tables do, but large whole numbers (bytes) as such."""
    whole = isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
    return f"{int(value):,}" if whole and abs(value) >= 1000 else number_cell(value)
