"""Headline figures of a job from its per-round records: the final, initial and best metrics."""

from __future__ import annotations

from typing import Any

FALLBACK_HEADLINES = ("server.accuracy", "server.loss", "federated.accuracy", "federated.loss", "train.loss")


SOURCE_ORDER = ("server", "federated", "personal", "train", "strategy", "transport")


def flat(record: dict[str, Any]) -> dict[str, float]:
    """A record's metrics as {"source.name": value}: server, federated, train, strategy, transport, others."""
    metrics = record.get("metrics", {})
    order = [s for s in SOURCE_ORDER if s in metrics] + sorted(set(metrics) - set(SOURCE_ORDER))
    return {f"{source}.{name}": value for source in order for name, value in metrics[source].items()}


def headline(record: dict[str, Any], objective: str | None = None) -> tuple[str, float] | None:
    """The one metric to show for a round: the objective's, else the first of a few usual ones."""
    metrics = flat(record)
    for name in (objective, *FALLBACK_HEADLINES, *sorted(metrics)):
        if name and name in metrics:
            return name, metrics[name]
    return None


def summarize(history: list[dict[str, Any]], objective: dict[str, Any] | None = None) -> dict[str, Any]:
    """Final, initial (round 0) and best metrics from a job's per-round records."""
    trained = [h for h in history if h["round"] > 0]
    out: dict[str, Any] = {"rounds": len(trained)}
    if history and history[0]["round"] == 0:
        out["initial"] = flat(history[0])
    if trained:
        last = trained[-1]
        out["final"] = flat(last)
        out["model_digest"] = last.get("model_digest")
    if objective:
        out["objective"] = objective
    return out
