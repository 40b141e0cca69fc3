"""Server-side evaluation: each global model on the Task's server data, when it has any."""

from __future__ import annotations

from pathlib import Path

import torch

from fedmq.common.task.contract import EvalContext
from fedmq.services.aggregator.jobs import AggJob

SERVER_BATCH = 1024


def evaluate_on_server(job: AggJob, server_round: int, data_dir: Path | None) -> dict[str, float] | None:
    """The metrics of the job's current model on the Task's server data; None when not evaluated.

    Evaluated when the spec asks for server evaluation, the round is one of its evaluation
    rounds (and round 0, the initial model), and the Task has server data. The data is loaded by
    the first evaluation and let go after the job's last round's (a later one loads it again).
    """
    if not job.spec.evaluate.server or not (server_round == 0 or job.spec.evaluates(server_round)):
        return None
    if not job.server_data_loaded:
        job.server_data = job.runtime.load_server_data(data_dir)
        job.server_data_loaded = True
    if job.server_data is None:
        return None
    ctx = EvalContext(
        round=server_round, seed=job.spec.seed, device=torch.device("cpu"), batch_size=SERVER_BATCH
    )
    metrics = dict(job.runtime.evaluate(job.model, job.server_data, ctx).metrics)
    if server_round >= job.spec.rounds:
        job.server_data, job.server_data_loaded = None, False
    return metrics
