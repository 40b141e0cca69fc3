"""Every PromQL query of the Grafana dashboard, asked of Prometheus' HTTP API as Grafana would ask it."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from tests.compose.stack import prometheus
from tests.conftest import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "fedmq.json"
# Grafana's $__rate_interval: max($__interval + scrape, 4 * scrape), with the datasource's 5 s scrape
# (deploy/grafana/provisioning/datasources/prometheus.yml) and a 5 s step: 20 s.
STEP_S = 5
RATE_INTERVAL = "20s"
# Panels of events a healthy job may never have (dead letters, client failures) end in `> 0`, so
# that Grafana draws nothing rather than a flat zero.
HIDES_ZEROS = re.compile(r"\s*>=?\s*0\s*$")

Answer = Literal["data", "zero", "none"]


@dataclass(frozen=True)
class Query:
    panel: str
    legend: str
    expr: str

    @property
    def name(self) -> str:
        """The panel, and the series' legend up to its first label: "Updates (rejected)"."""
        shown = re.split(r"[:{]", self.legend)[0].strip()
        return f"{self.panel} ({shown})" if shown else self.panel


def queries() -> Iterator[Query]:
    """Every target of every panel (rows' nested panels too)."""
    def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    for panel in walk(json.loads(DASHBOARD.read_text())["panels"]):
        for target in panel.get("targets", []):
            yield Query(panel["title"], target.get("legendFormat", ""), target["expr"])


def _has_values(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(v)) for series in result for _, v in series["values"])


def ask(query: Query, fl_job: str, start: float, end: float) -> Answer:
    """`data`: the query as written has numbers over [start, end]; `zero`: it hides zeros and has
    none, but without its `> 0` the series are there; `none`: nothing (a wrong name or label)."""
    expr = query.expr.replace("$fl_job", fl_job)  # the example's ids: letters, digits, hyphens
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    params = {"start": start, "end": end, "step": STEP_S}
    if _has_values(prometheus("/api/v1/query_range", query=expr, **params)["result"]):
        return "data"
    if HIDES_ZEROS.search(expr):
        shown = prometheus("/api/v1/query_range", query=HIDES_ZEROS.sub("", expr), **params)["result"]
        if _has_values(shown):
            return "zero"
    return "none"
