"""A DDP job's checkpoints at the aggregator: FEDMQ_KEEP_CHECKPOINTS prunes them as it prunes rounds'."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from fedmq.common.bus.base import Bus
from fedmq.common.messages import DdpModel, DdpStored
from fedmq.common.settings import Settings
from fedmq.services.aggregator.service import AggregatorService
from fedmq.services.aggregator.store import JobStore
from tests.unit.test_allow_list_services import Recording

SPEC = {"name": "ddp", "ddp": {"entry": "examples.ddp:main", "world_size": 2}}


def store(aggregator: AggregatorService, kind: str, step: int) -> str:
    weights = {"w": torch.full((4,), float(step))}
    aggregator.store_ddp_model(DdpModel(job_id="ddp-1", attempt=0, kind=kind, step=step, spec=SPEC,
                                        weights=weights))
    stored = aggregator.bus.sent[-1][1]  # type: ignore[attr-defined]
    assert isinstance(stored, DdpStored)
    return stored.digest


@pytest.mark.parametrize(("keep", "kept_steps"), [(0, [1, 2, 3, 4, 5]), (1, [4, 5]), (3, [3, 4, 5])])
def test_the_newest_checkpoints_and_the_final_model_are_kept(
    tmp_path: Path, keep: int, kept_steps: list[int]
) -> None:
    settings = Settings(state_dir=tmp_path, keep_checkpoints=keep)
    aggregator = AggregatorService(settings, cast(Bus, Recording()))
    digests = {step: store(aggregator, "checkpoint", step) for step in range(1, 6)}
    final = store(aggregator, "final", 0)
    store(aggregator, "checkpoint", 5)  # redelivered after the final: it keeps the final's
    job = JobStore(tmp_path / "aggregator", "ddp-1")
    held = {path.stem.partition("-")[0] for path in (job.root / "checkpoints").glob("*.safetensors")}
    assert held == {digests[step] for step in kept_steps} | {final}
    assert job.load_weights(digests[5])["w"][0] == 5.0  # the restart point is served
