"""A learner's model between tasks. On the host, with a Task that promises lean memory, it sends its
trained model's own tensors as the update (no copy: a large model would be held twice) and loads the
next task's global model into fresh ones, so an update the bus may still be sending never changes.
And a fused chunk starts from the global model, whatever the chunk before it left in the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fedmq.common.messages import TrainTask
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.learner.work import JobContext, Work
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


def test_a_task_that_does_not_promise_lean_memory_gets_a_copy() -> None:
    spec = small_job()
    runtime = TaskRuntime.for_job(spec)
    runtime.task.lean_memory = False  # type: ignore[misc]  # this instance only
    job = JobContext(spec, runtime, runtime.build_model())
    sent = job.trained_state()
    assert not job.lent
    assert all(sent[k].data_ptr() != v.data_ptr() for k, v in job.model.state_dict().items())


def test_a_fused_chunk_after_one_trained_alone_starts_from_the_global_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk that fell back to training its clients one at a time leaves the last one's weights in
    the model: the next fused chunk must start from the global model again (found in review)."""
    spec = small_job(train__fuse=True, clients__total=4)
    runtime = TaskRuntime.for_job(spec)
    global_weights = runtime.build_model().state_dict()
    tasks = [TrainTask(job_id="j", task_id=f"j:1:{c}", round=1, client=c, model_digest="d",
                       spec=spec.model_dump(mode="json")) for c in range(4)]
    fused_together = TaskRuntime.train_group

    def run(first_chunk_alone: bool) -> list[Any]:
        calls: list[int] = []

        def train_group(self: TaskRuntime, model: Any, datas: Any, ctxs: Any) -> Any:
            calls.append(len(datas))
            return None if first_chunk_alone and len(calls) == 1 else fused_together(self, model, datas, ctxs)

        monkeypatch.setattr(TaskRuntime, "train_group", train_group)
        work = Work(Settings(state_dir=tmp_path), "learner-0",
                    lambda job_id, digest, downlink: (dict(global_weights), 0), Metrics())
        monkeypatch.setattr(work, "group_limit", lambda job: 2)
        out = work.train_group(tasks)
        assert calls == [2, 2]
        return out

    together, after_alone = run(False), run(True)
    for a, b in zip(together[2:], after_alone[2:], strict=True):
        assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
