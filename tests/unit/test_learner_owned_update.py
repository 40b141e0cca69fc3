"""A learner's update is published owned (Encoded.owned): the in-memory bus reads its parts on the
aggregator's thread, after the learner trained its next client. Nothing of the update may change
meanwhile, not even an extra that a Task's own train() returned as a view of the model."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.codec import Encoded
from fedmq.common.messages import TrainTask, to_wire_parts
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.common.task.contract import ClientData, TrainContext, TrainResult
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.learner.work import Work
from tests.conftest import small_job


def test_an_update_in_its_owned_parts_does_not_change_when_the_next_client_trains(tmp_path: Path) -> None:
    spec = small_job()
    start = TaskRuntime.for_job(spec).build_model().state_dict()
    work = Work(Settings(state_dir=tmp_path), "learner-0", lambda job, digest, downlink: (dict(start), 0),
                Metrics())
    tasks = [TrainTask(job_id="j", task_id=f"j:1:{c}", round=1, client=c, model_digest="d",
                       spec=spec.model_dump(mode="json")) for c in range(2)]
    job = work._job("j", tasks[0].spec)
    job.runtime.task.lean_memory = False  # type: ignore[misc]  # load_state_dict then writes in place

    def train(model: nn.Module, data: ClientData, ctx: TrainContext) -> TrainResult:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 + ctx.client)
        return TrainResult(10, {}, {"head": list(model.parameters())[-1].detach()})  # a view of the model

    job.runtime.task.train = train  # type: ignore[attr-defined]
    broker = MemoryBroker()
    parts = to_wire_parts(work.train(tasks[0]))
    parts.owned = True  # as LearnerService._do publishes it
    sent = parts.join()  # what RabbitMQ takes at publish
    broker.connect().publish("fedmq.aggregator", parts)
    work.train(tasks[1])  # the learner trains on before the aggregator's thread reads the parts
    body = broker._queues["fedmq.aggregator"].ready[0].body
    assert isinstance(body, Encoded) and body.join() == sent
