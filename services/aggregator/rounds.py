"""Closing a round: the round's stored updates through the job's strategy into the next global model."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from fedmq.common.checkpoint import save_model
from fedmq.common.jobspec import canonical_json
from fedmq.common.messages import RoundClosed
from fedmq.common.task.metrics import reduce_metrics
from fedmq.services.aggregator.jobs import AggJob, views
from fedmq.services.aggregator.store import JobStore
from fedmq.services.aggregator.strategies import ClientResult


def aggregate_round(job: AggJob, server_round: int, clients: list[int]) -> RoundClosed:
    """Fold the clients' updates into the job's model, checkpoint it, and describe the round.

    The returned RoundClosed has the clients' training metrics, combined by the Task's rules;
    the caller adds the evaluation of the new model.
    """
    results = client_results(job.store, server_round, clients)
    new = job.strategy.aggregate(server_round, job.weights, results)
    job.model.load_state_dict(new)  # copies into the parameters, dtypes kept
    del new
    job.weights = views(job.model)
    job.digest = job.store.save_checkpoint(server_round, job.weights, job.strategy.state())
    job.round, job.open_round, job.expected = server_round, None, set()
    closed = RoundClosed(
        job_id=job.job_id,
        round=server_round,
        model_digest=job.digest,
        clients=[r.client for r in results],
        num_examples=sum(r.num_examples for r in results),
        metrics={"train": train_metrics(results, job.runtime.reductions)},
    )
    if server_round == job.spec.rounds:
        path = save_model(
            job.store.root / "model.safetensors", job.weights, canonical_json(job.spec),
            job_id=job.job_id, round=server_round,
        )
        closed = closed.model_copy(update={"model_path": str(path)})
        job.runtime.export(job.model, job.store.root / "artifacts", server_round)
    return closed


def train_metrics(results: list[ClientResult], rules: dict[str, str]) -> dict[str, float]:
    """The clients' training metrics combined: weighted by examples, or by the Task's rules."""
    return reduce_metrics([(r.num_examples, r.metrics) for r in results], rules)


def client_results(store: JobStore, server_round: int, clients: list[int]) -> list[ClientResult]:
    """The round's stored updates for `clients`, in client order, weights read lazily from disk."""
    out = []
    for client in sorted(set(clients)):
        stored = store.read_update(server_round, client)
        out.append(
            ClientResult(
                client=client,
                num_examples=int(stored.fields["num_examples"]),
                metrics={str(k): float(v) for k, v in dict(stored.fields.get("metrics", {})).items()},
                load=functools.partial(_itself, stored),
            )
        )
    return out


def _itself(value: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    return value
