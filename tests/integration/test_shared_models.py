"""Learners of one host share the large global models they fetch (FEDMQ_SHARED_MODELS_DIR).

Two learners on RabbitMQ, a model over the frame size (shrunk here: frame 64 KiB, SMALL_FILE
1 KiB): each round's model crosses the broker once, the other learner reads it from the shared
folder, and the run ends with the engine's bits. A file planted in the folder under the first
model's digest, holding other weights, is refused (its tensors do not hash to the digest),
removed and fetched instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmq.common import messages
from fedmq.common.allowlist import AllowList
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.codec import state_digest
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import ModelReply, to_wire_parts
from fedmq.common.settings import Settings
from fedmq.services.aggregator.jobs import new_job
from fedmq.services.cli.embedded import run_job
from fedmq.services.learner import service as learner_service
from fedmq.services.learner.models import SharedModels
from fedmq.services.learner.work import JobContext, Widened, Work
from tests.conftest import EmbeddedRuns, assert_bit_identical, small_job
from tests.rabbit import fresh_vhost

pytestmark = pytest.mark.rabbitmq


def test_learners_of_one_host_fetch_each_model_once_and_refuse_a_planted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(task__options__model__hidden=[512], clients__total=8, rounds=3)
    expected = embedded_runs.weights(spec)
    monkeypatch.setattr(messages, "SMALL_FILE", 1024)
    monkeypatch.setattr(learner_service, "large_buffers_unmapped", lambda: None)  # not in this process
    shared = tmp_path / "shared"
    shared.mkdir()
    initial = new_job(tmp_path / "agg", "probe", spec, AllowList.services(("tests", "examples"))).weights
    first = state_digest(initial)
    planted = {name: torch.zeros_like(t) for name, t in initial.items()}
    impostor = ModelReply(job_id="x", digest=first, weights=planted)
    (shared / f"{first}.msg").write_bytes(to_wire_parts(impostor).join())
    taken: list[bool] = []
    take = SharedModels.take

    def recording(self: SharedModels, digest: str, into: Path) -> tuple[Path, tuple[int, ...]] | None:
        found = take(self, digest, into)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(SharedModels, "take", recording)
    result = two_learners(spec, tmp_path, shared, expected, frame_bytes=64 * 1024)
    assert sum(result["model_fetches"]) == spec.rounds, "each round's model crossed the broker once"
    assert taken[0] is True, "the planted file was taken, checked and refused"
    assert any(taken[1:]), "the other learner read a model its neighbour fetched"
    kept = sorted(p.name for p in shared.glob("*.msg"))
    assert f"{first}.msg" in kept and len(kept) == spec.rounds, kept
    reply = messages.from_wire_file(shared / f"{first}.msg", max_bytes=1 << 30)
    assert isinstance(reply, ModelReply) and reply.weights is not None
    assert state_digest(reply.weights) == first, "the real one now"


def test_a_model_that_comes_whole_is_not_shared_nor_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(clients__total=4, rounds=2)  # 32 hidden units: one frame
    turns: list[str] = []
    turn = SharedModels.turn

    def counting(self: SharedModels, digest: str) -> contextlib.AbstractContextManager[None]:
        turns.append(digest)
        return turn(self, digest)

    monkeypatch.setattr(SharedModels, "turn", counting)
    shared = tmp_path / "shared"
    two_learners(spec, tmp_path, shared, embedded_runs.weights(spec))
    assert list(shared.glob("*.msg")) == [], "nothing to share"
    assert len(turns) <= 2, "each learner waits its turn once a job, to learn its models come whole"


def test_a_rounded_downlink_over_rabbitmq_is_the_engines_run_and_is_not_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(task__options__model__hidden=[512], clients__total=4, rounds=2,
                     compression={"downlink": "bfloat16"})
    expected = embedded_runs.weights(spec)
    monkeypatch.setattr(messages, "SMALL_FILE", 1024)  # the rounded model comes in chunks, to a file
    monkeypatch.setattr(learner_service, "large_buffers_unmapped", lambda: None)
    kinds: list[type] = []
    weights_of = Work._weights

    def recording(
        self: Work, job: JobContext, job_id: str, digest: str, pushed: bytes = b""
    ) -> tuple[Mapping[str, Any], int]:
        weights, size = weights_of(self, job, job_id, digest, pushed)
        kinds.append(type(weights))
        return weights, size

    monkeypatch.setattr(Work, "_weights", recording)
    shared = tmp_path / "shared"
    two_learners(spec, tmp_path, shared, expected, frame_bytes=64 * 1024)
    assert kinds and set(kinds) == {Widened}, "the large rounded model stays in its file, widened as read"
    assert list(shared.glob("*.msg")) == [], "a rounded model is not the digest's: never shared"


def two_learners(
    spec: JobSpec, tmp_path: Path, shared: Path, expected: dict[str, torch.Tensor], **settings: Any
) -> dict[str, Any]:
    """`spec` run to its end on RabbitMQ by two learners sharing `shared`, ending with `expected`."""
    with fresh_vhost() as url:
        config = Settings(broker_url=url, state_dir=tmp_path / "state", log_format="json",
                          shared_models_dir=shared, **settings)
        result = run_job(spec, config, learners=2, connect=lambda name: RabbitBus(config, name),
                         idle_timeout=60)
    assert result["status"] == "completed", result
    assert_bit_identical(load_state(result["model_path"])[0], expected)
    return result
