"""The record of a closed round, the best round so far, and federated evaluation's sample: pure helpers.

RoundClosed(r) ─▶ record ─┬─(federated evaluation due at r)─▶ EvalTask × k ─▶ EvalReports
                          │                                      ─▶ record.metrics.federated
                          └─▶ history, best round, event round_completed, round r + 1
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import EvalReport, RoundClosed, UpdateAccepted
from fedmq.common.seeding import numpy_rng
from fedmq.common.task.metrics import lookup, reduce_metrics

# Of one round's failed clients, in its record: enough to see why, and at most ~3 KB a round (the
# history travels whole in status replies). The reason names where it ran: the learner, or "engine".
FAILURES_KEPT = 10
FAILURE_REASON_CHARS = 300


def add_sync(sync: dict[str, float], msg: UpdateAccepted) -> None:
    """Add an accepted update's traffic and time to its round's sums."""
    for key, value in (
        ("train_seconds", msg.train_seconds), ("fetch_seconds", msg.fetch_seconds),
        ("bytes_up", msg.bytes), ("bytes_down", msg.fetch_bytes),
    ):
        sync[key] = sync.get(key, 0.0) + value


def add_eval_sync(sync: dict[str, float], msg: EvalReport) -> None:
    """Add the global model a client's evaluation fetched to its round's sums."""
    sync["bytes_down"] = sync.get("bytes_down", 0.0) + msg.fetch_bytes
    sync["fetch_seconds"] = sync.get("fetch_seconds", 0.0) + msg.fetch_seconds


def federated_due(spec: JobSpec, server_round: int) -> bool:
    """Whether clients evaluate the global model of this round."""
    return server_round > 0 and spec.evaluate.federated is not None and spec.evaluates(server_round)


def eval_clients(spec: JobSpec, server_round: int) -> list[int]:
    """The clients that evaluate this round's model: a seeded draw, sorted, like training's."""
    assert spec.evaluate.federated is not None
    k = min(spec.evaluate.federated.clients, spec.clients.total)
    rng = numpy_rng(spec.seed, "evaluate", server_round)
    return sorted(int(c) for c in rng.choice(spec.clients.total, size=k, replace=False))


def combine_reports(reports: dict[int, dict[str, Any]], key: str = "metrics") -> dict[str, float]:
    """The clients' evaluation metrics (`key`: or their personal models') as one value per name, by
    the rules the reports carry."""
    rules: dict[str, str] = {}
    for report in reports.values():
        rules.update(report.get("reduction", {}))
    pairs = [(int(r["num_examples"]), r[key]) for _, r in sorted(reports.items()) if key in r]
    return reduce_metrics([(n, m) for n, m in pairs if n > 0], rules)


def evaluated(reports: dict[int, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """A federated evaluation's metric sources: `federated` (the global model on each client's
    validation data), and `personal` (each client's own model, under personalize) when reported."""
    sources = {"federated": combine_reports(reports)}
    personal = {c: r for c, r in reports.items() if r.get("personal")}
    if personal:
        sources["personal"] = combine_reports(personal, "personal")
    return sources


def report_entry(report: EvalReport) -> dict[str, Any]:
    """What a federated evaluation keeps of a client's report until its round is recorded."""
    return {"num_examples": report.num_examples, "metrics": report.metrics, "personal": report.personal,
            "reduction": report.reduction}


def round_record(
    msg: RoundClosed, sync: dict[str, float], clients: int, failed: int, seconds: float,
    failures: Sequence[tuple[int, str, str]] = (),
) -> dict[str, Any]:
    """What the history keeps of a closed round; `failures`: (client, reason, phase) of the sampled
    clients that sent no update (RoundState.unreported), the first FAILURES_KEPT of them kept."""
    record = {
        "round": msg.round,
        "metrics": {source: dict(values) for source, values in msg.metrics.items()},
        "clients": clients,
        "failed": failed,
        "num_examples": msg.num_examples,
        "seconds": seconds,
        "model_digest": msg.model_digest,
        "model_path": msg.model_path,
        "sync": {**sync, "aggregate_seconds": msg.aggregate_seconds},
        "client_metrics": {str(c): dict(m) for c, m in sorted(msg.client_metrics.items())
                           if c in msg.clients},  # only the round's own
    }
    if failures:
        record["failures"] = [{"client": c, "phase": phase, "reason": reason[:FAILURE_REASON_CHARS]}
                              for c, reason, phase in failures[:FAILURES_KEPT]]
    return record


def better(spec: JobSpec, record: dict[str, Any], best: dict[str, Any] | None) -> dict[str, Any] | None:
    """The new best round if `record` beats `best` on the spec's objective, else None."""
    if spec.objective is None:
        return None
    value = lookup(record["metrics"], spec.objective.metric)
    if value is None or not math.isfinite(value):
        return None
    if best is not None:
        ahead = value > best["value"] if spec.objective.mode == "max" else value < best["value"]
        if not ahead:
            return None
    return {"round": record["round"], "value": value, "model_digest": record["model_digest"]}
