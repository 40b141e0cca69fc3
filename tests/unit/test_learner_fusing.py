"""Which tasks a learner trains together, and in groups of how many."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedmq.common.messages import TrainTask
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.services.learner.work import CPU_FUSE_CLIENTS, Work
from tests.conftest import small_job


def work(tmp_path: Path, fuse_clients: int | None = None) -> Work:
    settings = Settings(state_dir=tmp_path, fuse_clients=fuse_clients)
    return Work(settings, "learner-0", lambda *_: ({}, 0), Metrics())


def test_unset_a_cpu_learner_fuses_64_and_an_accelerators_each_client_alone(tmp_path: Path) -> None:
    cpu = work(tmp_path)
    assert cpu.fuse_clients == CPU_FUSE_CLIENTS == 64
    cpu.device = torch.device("cuda")  # only its type is read: no GPU needed
    assert cpu.fuse_clients == 1, "a group's size may move a client's last bits on a GPU"
    assert work(tmp_path, fuse_clients=5).fuse_clients == 5


@pytest.mark.parametrize(("hidden", "fused"), [([32], True), ([1024], False)])
def test_a_learner_gathers_tasks_only_of_a_job_whose_model_fuses_here(
    tmp_path: Path, hidden: list[int], fused: bool
) -> None:
    # digits' MLP 64 -> hidden -> 10: 32 wide is 9 KiB, 1024 wide 300 KiB (over a CPU's 128 KiB).
    spec = small_job(task__options__model__hidden=hidden)
    task = TrainTask(job_id="j", task_id="j:1:0", round=1, client=0, model_digest="d",
                     spec=spec.model_dump(mode="json"))
    learner = work(tmp_path)
    assert learner.fusable(task) is fused
    if not fused:
        assert "one client at a time on a CPU" in learner.unfused_reason(task)
