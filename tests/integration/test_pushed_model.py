"""A small global model comes with the round's tasks: the learner trains on it only if its tensors
hash to the digest the task names, and otherwise fetches the model by that digest. The aggregator
sends it with its RoundClosed when it is small and sent as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedmq.common import codec
from fedmq.common.checkpoint import load_state
from fedmq.common.codec import state_digest
from fedmq.common.messages import TrainTask
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.common.task.runtime import TaskRuntime
from fedmq.services.cli.embedded import run_job
from fedmq.services.learner.work import Work
from tests.conftest import assert_bit_identical, small_job
from tests.integration.conftest import Transport


def trained(tmp_path: Path, pushed: bytes, digest: str) -> tuple[int, list[str]]:
    """Bytes the task's model took, and the digests fetched from the aggregator."""
    spec = small_job()
    model = TaskRuntime.for_job(spec).build_model().state_dict()
    fetched: list[str] = []

    def fetch(job_id: str, asked: str, downlink: str) -> tuple[dict[str, torch.Tensor], int]:
        fetched.append(asked)
        return dict(model), 12345

    work = Work(Settings(state_dir=tmp_path), "learner-0", fetch, Metrics())
    task = TrainTask(job_id="j", task_id="j:1:0", round=1, client=0, model_digest=digest,
                     spec=spec.model_dump(mode="json"), model=pushed)
    return work.train(task).fetch_bytes, fetched


def test_a_model_that_came_with_the_task_is_used_when_it_hashes_to_its_digest(tmp_path: Path) -> None:
    model = TaskRuntime.for_job(small_job()).build_model().state_dict()
    digest = state_digest(model)
    packed = codec.packb(dict(model))
    assert trained(tmp_path, packed, digest) == (len(packed), [])
    forged = codec.packb({k: v + 1 for k, v in model.items()})
    assert trained(tmp_path / "forged", forged, digest) == (12345, [digest]), "fetched instead"
    assert trained(tmp_path / "garbled", packed[:-3], digest) == (12345, [digest])
    assert trained(tmp_path / "none", b"", digest) == (12345, [digest])


@pytest.mark.parametrize("limit", [0, 1024**2])
def test_a_job_gives_the_same_bits_whether_its_model_is_pushed_or_fetched(
    transport: Transport, tmp_path: Path, limit: int
) -> None:
    spec = small_job(rounds=2, clients__per_round=4)
    settings = Settings(**{**transport.settings.model_dump(), "push_model_bytes": limit})
    result = run_job(spec, settings, learners=2, connect=transport.connect, idle_timeout=60)
    assert result["status"] == "completed"
    assert (sum(result["model_fetches"]) == 0) == bool(limit), "pushed: no learner fetched a model"
    alone = run_job(spec, Settings(state_dir=tmp_path / "alone", push_model_bytes=0), idle_timeout=60)
    assert_bit_identical(load_state(result["model_path"])[0], load_state(alone["model_path"])[0])
