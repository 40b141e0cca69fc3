"""Headline figures of a finished job from its per-round records."""

from __future__ import annotations

from typing import Any


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Final, best and initial accuracy from a job's per-round records (round 0 = initial model)."""
    trained = [h for h in history if h["round"] > 0]
    out: dict[str, Any] = {"rounds": len(trained)}
    if history and history[0]["round"] == 0:
        out["initial_accuracy"] = history[0]["test_accuracy"]
    if trained:
        best = max(trained, key=lambda h: h["test_accuracy"])
        last = trained[-1]
        out |= {
            "final_accuracy": last["test_accuracy"],
            "final_loss": last["test_loss"],
            "best_accuracy": best["test_accuracy"],
            "best_round": best["round"],
            "model_digest": last.get("model_digest"),
        }
    return out
