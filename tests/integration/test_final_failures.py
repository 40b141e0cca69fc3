"""A client whose failure every attempt repeats (it holds no data) is not sent again when its round
retries the others: on the services and in the engine alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fedmq
from fedmq.common.jobspec import JobSpec, parse_job
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job as on_services
from fedmq.services.engine.run import run_job
from tests.integration.conftest import Transport


class OneEmptyOneFlaky(fedmq.Task):
    """Client 1 holds no data; client 2's loss raises the first time it is called in a process
    (a marker file says it was), as a flaky read would."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    def build_model(self) -> nn.Module:
        return nn.Linear(2, 1)

    def load_data(self, ctx: fedmq.DataContext) -> tuple[torch.Tensor, torch.Tensor]:
        n = 0 if ctx.client == 1 else 4
        return torch.ones(n, 2), torch.full((n, 1), float(ctx.client))

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        if float(y[0]) == 2.0 and not self.marker.exists():
            self.marker.write_text("failed once")
            raise OSError("a flaky read")
        return nn.functional.mse_loss(model(x), y)


def spec(marker: Path) -> JobSpec:
    return parse_job({
        "name": "final", "task": {"name": f"{__name__}:OneEmptyOneFlaky", "options": {"marker": str(marker)}},
        "clients": {"total": 3, "on_error": "drop_client"}, "rounds": 1, "max_round_retries": 2,
        "train": {"fuse": False}, "evaluate": {"server": False}, "round_timeout_s": 30,
    })


def test_a_client_without_data_is_tried_once_while_the_round_retries_another(
    transport: Transport, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    services = on_services(spec(tmp_path / "services.marker"), transport.settings, connect=transport.connect,
                           idle_timeout=60)
    engine = run_job(spec(tmp_path / "engine.marker"), Settings(state_dir=tmp_path / "engine"))
    for result in (services, engine):  # client 2 came back on the retry; client 1 cannot: no quorum
        assert result["status"] == "failed" and "no_data: client 1 has no training data" in result["reason"]
    captured = capfd.readouterr()
    logs = captured.out + captured.err
    tried = [line for line in logs.splitlines() if "task_failed" in line and "no training data" in line]
    assert len(tried) == 2, logs[-3000:]  # once on each path: no retry sent client 1's task again
    assert sum("user_code_failed" in line and "a flaky read" in line for line in logs.splitlines()) == 2
