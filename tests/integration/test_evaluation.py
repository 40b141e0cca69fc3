"""Federated evaluation and the objective, on both buses: sampled clients evaluate the global model
on their own validation data; the metrics combine by examples or by the Task's rules."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import fedmq
from fedmq.common.checkpoint import load_state
from fedmq.services.cli.embedded import run_job
from tests.conftest import EmbeddedRuns, assert_bit_identical, small_job
from tests.integration.conftest import Transport


def test_clients_evaluate_every_second_round_without_changing_the_weights(
    transport: Transport, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(rounds=4, evaluate={"every": 2, "federated": {"clients": 3}})
    result = run_job(spec, transport.settings, learners=2, connect=transport.connect, idle_timeout=60)
    assert result["status"] == "completed"
    evaluated = [h["round"] for h in result["history"] if "federated" in h["metrics"]]
    assert evaluated == [2, 4]
    assert all(h["evaluated_by"] == 3 for h in result["history"] if h["round"] in (2, 4))
    assert set(result["history"][4]["metrics"]["federated"]) == {"loss", "accuracy"}
    assert 0 <= result["history"][4]["metrics"]["federated"]["accuracy"] <= 1
    assert [h["round"] for h in result["history"] if "server" in h["metrics"]] == [0, 2, 4]
    undisturbed = embedded_runs.weights(small_job(rounds=4))
    assert_bit_identical(load_state(result["model_path"])[0], undisturbed)


class Perplexity(fedmq.Task):
    """A tiny Task whose evaluation reports a perplexity combined as a geometric mean."""

    metric_reduction = {"perplexity": "geometric", "seen": "sum"}

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        n = 2 + ctx.client  # clients hold 2, 3, 4, ... examples
        x = torch.ones(n, 1) * (ctx.client + 1)
        return fedmq.ClientData(train=(x, x), val=(x, x))

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def evaluate(self, model: nn.Module, data: Any, ctx: fedmq.EvalContext) -> dict[str, float]:
        x, _ = data
        return {"perplexity": float(x[0, 0]), "seen": float(len(x))}


def test_federated_metrics_combine_by_the_tasks_rules(settings: Any) -> None:
    spec = small_job(
        task={"name": f"{__name__}:Perplexity"},
        clients={"total": 3},
        rounds=1,
        evaluate={"server": False, "federated": {"clients": 3}},
        objective={"metric": "federated.perplexity", "mode": "min"},
    )
    result = run_job(spec, settings, idle_timeout=60)
    assert result["status"] == "completed"
    federated = result["history"][-1]["metrics"]["federated"]
    expected = math.exp((2 * math.log(1) + 3 * math.log(2) + 4 * math.log(3)) / 9)
    assert federated["perplexity"] == pytest.approx(expected)
    assert federated["seen"] == 9
    assert result["best"] == {
        "round": 1,
        "value": pytest.approx(expected),
        "model_digest": result["model_digest"],
    }
