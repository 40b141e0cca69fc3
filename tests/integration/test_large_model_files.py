"""A learner on RabbitMQ keeps a large model it fetched in a file, read a tensor at a time.

The model's reply comes in chunks (over the frame size); a reply over SMALL_FILE bytes goes to a
file of the learner's model folder as its chunks arrive, loads into the model a tensor at a time,
and stays the cached copy for the round's next clients. Shrunk here (frame 64 KiB, SMALL_FILE 1 KiB)
so that a 150 KB model takes that path: the run ends with the in-memory run's bits, and the folder
is gone once the learner stops; a model the cache drops takes its file with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from fedmq.common import messages
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.codec import TensorFile
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from fedmq.services.learner import service as learner_service
from fedmq.services.learner.work import MODEL_CACHE, JobContext, Work
from tests.conftest import EmbeddedRuns, assert_bit_identical, small_job
from tests.rabbit import fresh_vhost

pytestmark = pytest.mark.rabbitmq


def test_a_large_model_trains_from_its_file_to_the_in_memory_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(task__options__model__hidden=[512], clients__total=4, rounds=3)
    expected = embedded_runs.weights(spec)
    monkeypatch.setattr(messages, "SMALL_FILE", 1024)
    cached: list[tuple[type, bool]] = []  # what each task's global model was, and whether its file existed
    kept: list[int] = []  # model files in the learner's folder then
    weights_of = Work._weights

    def recording(
        self: Work, job: JobContext, job_id: str, digest: str, pushed: bytes = b""
    ) -> tuple[Mapping[str, torch.Tensor], int]:
        weights, size = weights_of(self, job, job_id, digest, pushed)
        cached.append((type(weights), isinstance(weights, TensorFile) and Path(weights.path).exists()))
        if isinstance(weights, TensorFile):
            kept.append(len(list(Path(weights.path).parent.glob("*.msg"))))
        return weights, size

    monkeypatch.setattr(Work, "_weights", recording)
    # From the first large model on, a learner fixes glibc's mmap threshold: not in this test process.
    unmapped: list[int] = []
    monkeypatch.setattr(learner_service, "large_buffers_unmapped", lambda: unmapped.append(1))
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path / "state", log_format="json",
                            frame_bytes=64 * 1024)
        result = run_job(spec, settings, connect=lambda name: RabbitBus(settings, name), idle_timeout=60)
    assert result["status"] == "completed", result
    assert cached and all(kind is TensorFile and exists for kind, exists in cached), cached
    assert result["model_fetches"] == [spec.rounds], "fetched once a round, then read from its file"
    assert max(kept) == MODEL_CACHE, "a model the cache drops takes its file with it"
    assert unmapped, "a large model makes the learner give freed buffers back"
    assert_bit_identical(load_state(result["model_path"])[0], expected)
    assert list((tmp_path / "state" / "learner").glob("models-*")) == [], "the folder goes with the learner"
