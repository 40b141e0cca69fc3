"""A learner on the host sends its trained model's own tensors as the update (no copy: a large model
would be held twice), and loads the next task's global model into fresh ones, so an update the bus
may still be sending never changes."""

from __future__ import annotations

import torch

from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.learner.work import JobContext
from tests.conftest import small_job


def test_an_update_keeps_the_trained_tensors_and_the_next_load_gets_fresh_ones() -> None:
    spec = small_job()
    runtime = TaskRuntime.for_job(spec)
    job = JobContext(spec, runtime, runtime.build_model())
    first = {k: torch.full_like(v, 1.0) for k, v in job.model.state_dict().items()}
    second = {k: torch.full_like(v, 2.0) for k, v in job.model.state_dict().items()}
    params = dict(job.model.named_parameters())

    job.load(first, 1, 0)
    sent = job.trained_state()
    mine = job.model.state_dict()
    assert job.lent
    assert all(sent[k].data_ptr() == mine[k].data_ptr() for k in sent), "the model's own tensors, not a copy"

    job.load(second, 2, 0)  # the next task: while the bus may still send `sent`
    assert not job.lent
    assert all(torch.equal(sent[k], first[k]) for k in sent), "the update is unchanged"
    assert all(torch.equal(v, second[k]) for k, v in job.model.state_dict().items())
    assert dict(job.model.named_parameters()) == params, "the same Parameters (a Task may hold them)"

    where = {k: v.data_ptr() for k, v in job.model.state_dict().items()}
    job.load(first, 3, 0)  # nothing lent since: loaded in place
    assert {k: v.data_ptr() for k, v in job.model.state_dict().items()} == where
