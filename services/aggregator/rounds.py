"""A round's new global model: aggregated, evaluated, then committed in an order that survives a crash.

    aggregate ─▶ into the model ─▶ evaluate (user code) ─▶ checkpoint ─▶ [final model] ─▶ closed.json
              ─▶ rounds.json (the commit: a restart resumes from the last round it names)

Anything that fails before the commit leaves the job's committed state as it was; the caller
puts the in-memory model back to it (jobs.rewind) before it tries again or gives up.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping

import torch

from fedmq.common.checkpoint import save_model
from fedmq.common.jobspec import canonical_json
from fedmq.common.messages import RoundClosed
from fedmq.common.usercode import user_code
from fedmq.services.aggregator.evaluation import evaluate
from fedmq.services.aggregator.jobs import AggJob, views
from fedmq.services.aggregator.store import JobStore
from fedmq.services.aggregator.strategies import ClientResult


def initial_round(job: AggJob) -> RoundClosed:
    """Round 0: the spec and the freshly built model, evaluated and committed."""
    job.store.save_spec(canonical_json(job.spec))
    return commit(job, RoundClosed(job_id=job.job_id, round=0, model_digest="", test_loss=0, test_accuracy=0))


def close_round(job: AggJob, server_round: int, clients: list[int]) -> RoundClosed:
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
        test_loss=0,
        test_accuracy=0,
        train_loss=_weighted(results, "loss"),
        train_accuracy=_weighted(results, "accuracy"),
        aggregate_seconds=time.perf_counter() - started,
    ))


def commit(job: AggJob, closed: RoundClosed) -> RoundClosed:
    """Evaluate the job's model, store it, and make it the round's: the RoundClosed to announce."""
    with user_code("evaluate", round=closed.round):
        loss, accuracy = evaluate(job.model, job.x_test, job.y_test)
    digest = job.store.write_checkpoint(closed.round, job.weights, job.strategy.state())
    update: dict[str, object] = {"model_digest": digest, "test_loss": loss, "test_accuracy": accuracy}
    if closed.round == job.spec.rounds:
        path = save_model(
            job.store.root / "model.safetensors", job.weights, canonical_json(job.spec),
            job_id=job.job_id, round=closed.round,
        )
        update["model_path"] = str(path)
    closed = closed.model_copy(update=update)
    job.store.save_json("closed", closed.model_dump())  # before the commit: a restart re-sends it
    job.store.commit_round(closed.round, digest)
    job.digest, job.round, job.last_closed = digest, closed.round, closed
    job.open_round, job.expected = None, set()
    return closed


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


def _weighted(results: list[ClientResult], key: str) -> float | None:
    pairs = [(r.metrics[key], r.num_examples) for r in results if key in r.metrics]
    total = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / total if total else None
