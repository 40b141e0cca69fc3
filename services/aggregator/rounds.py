"""A round's new global model: aggregated, evaluated, then committed in an order that survives a crash.

    aggregate ─▶ into the model ─▶ evaluate (the Task's server data) ─▶ checkpoint ─▶ [final model,
              the Task's export] ─▶ closed.json ─▶ rounds.json (the commit: a restart resumes from
              the last round it names)

Anything that fails before the commit leaves the job's committed state as it was; the caller
puts the in-memory model back to it (jobs.rewind) before it tries again or gives up.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from fedmq.common.checkpoint import save_model
from fedmq.common.jobspec import canonical_json
from fedmq.common.messages import RoundClosed
from fedmq.common.task.metrics import reduce_metrics
from fedmq.services.aggregator.evaluation import evaluate_on_server
from fedmq.services.aggregator.jobs import AggJob, views
from fedmq.services.aggregator.store import JobStore
from fedmq.services.aggregator.strategies import ClientResult


def initial_round(job: AggJob, data_dir: Path | None) -> RoundClosed:
    """Round 0: the spec and the freshly built model, evaluated and committed."""
    job.store.save_spec(canonical_json(job.spec))
    return commit(job, RoundClosed(job_id=job.job_id, round=0, model_digest=""), data_dir)


def close_round(job: AggJob, server_round: int, clients: list[int], data_dir: Path | None) -> RoundClosed:
    """Fold the clients' stored updates into the job's model with its strategy, then commit it."""
    started = time.perf_counter()
    results = client_results(job.store, server_round, clients)
    new = job.strategy.aggregate(server_round, job.weights, results)
    job.model.load_state_dict(new)  # copies into the parameters, dtypes kept
    del new
    job.weights = views(job.model)
    return commit(job, RoundClosed(
        job_id=job.job_id,
        round=server_round,
        model_digest="",
        clients=[r.client for r in results],
        num_examples=sum(r.num_examples for r in results),
        metrics={"train": train_metrics(results, job.runtime.reductions)},
        aggregate_seconds=time.perf_counter() - started,
    ), data_dir)


def commit(job: AggJob, closed: RoundClosed, data_dir: Path | None) -> RoundClosed:
    """Evaluate the job's model, store it, and make it the round's: the RoundClosed to announce."""
    metrics = dict(closed.metrics)
    server = evaluate_on_server(job, closed.round, data_dir)
    if server is not None:
        metrics["server"] = server
    digest = job.store.write_checkpoint(closed.round, job.weights, job.strategy.state())
    update: dict[str, object] = {"model_digest": digest, "metrics": metrics}
    if closed.round == job.spec.rounds:
        path = save_model(
            job.store.root / "model.safetensors", job.weights, canonical_json(job.spec),
            job_id=job.job_id, round=closed.round, metrics=metrics,
        )
        update["model_path"] = str(path)
        job.runtime.export(job.model, job.store.root / "artifacts", closed.round)
    closed = closed.model_copy(update=update)
    job.store.save_json("closed", closed.model_dump())  # before the commit: a restart re-sends it
    job.store.commit_round(closed.round, digest)
    job.digest, job.round, job.last_closed = digest, closed.round, closed
    job.open_round, job.expected = None, set()
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
