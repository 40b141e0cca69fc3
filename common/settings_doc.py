"""The configuration page's table (docs/configuration.md), rendered from the Settings class so the
two cannot drift.

`python -m fedmq.common.settings_doc` prints it; `--write docs/configuration.md` replaces the table
between the markers in place. A test fails when the page's copy differs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fedmq.common.settings import Settings

BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def table() -> str:
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "(unset)" if default is None else f"`{default}`" if default != "" else "(empty)"
        rows.append(f"| `FEDMQ_{name.upper()}` | {shown} | {field.description or ''} |")
    return "\n".join(rows)


def render(page: str) -> str:
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        path = Path(sys.argv[2])
        path.write_text(render(path.read_text()))
    else:
        print(table())
