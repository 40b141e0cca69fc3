"""Seed 002's trainer on RabbitMQ: two learners that seal their workers' state, one SIGKILLed
mid-training and started again. The trained workers `train()` returns end as the in-process run's,
bit for bit, and worker 0 scores as well."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.cluster import Cluster
from tests.integration.test_miniray_workers import EPOCHS, SYNC, WORKERS, CnnTrainer, accuracy
from tests.rabbit import fresh_vhost

pytestmark = pytest.mark.rabbitmq  # a real broker

KEY = "the learners' state key"
KILL_AT_SYNC = 2
CLUSTER: Cluster | None = None  # set in the test's own process only: the learners never kill
KILLED: list[int] = []  # the syncs after which learner-0 was killed


class KilledCnnTrainer(CnnTrainer):
    def on_epoch_end(self, epoch: int, result: dict[str, Any], **kwargs: Any) -> None:
        if CLUSTER is not None and result["sync_version"] == KILL_AT_SYNC:
            CLUSTER.stop("learner-0", signal.SIGKILL)  # the next round's tasks are in flight or queued
            KILLED.append(result["sync_version"])
            CLUSTER.start("learner", "learner-0", FEDMQ_REPLICA="0", FEDMQ_STATE_KEY=KEY)


def test_workers_trained_over_rabbitmq_with_a_learner_killed_end_as_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    global CLUSTER
    monkeypatch.chdir(tmp_path)
    here = CnnTrainer(num_workers=WORKERS, sync_interval=SYNC).train(epochs=EPOCHS)
    monkeypatch.setenv("FEDMQ_STATE_KEY", KEY)  # this process opens the workers' sealed state
    with fresh_vhost() as url:
        cluster = Cluster(url, tmp_path)
        try:
            cluster.start("scheduler")
            cluster.start("aggregator")
            for i in range(2):
                cluster.start("learner", f"learner-{i}", FEDMQ_REPLICA=str(i), FEDMQ_STATE_KEY=KEY)
            cluster.wait_learners(2)
            CLUSTER = cluster
            trainer = KilledCnnTrainer(num_workers=WORKERS, sync_interval=SYNC, broker=url)
            there = trainer.train(epochs=EPOCHS)
        finally:
            CLUSTER = None
            cluster.close()
            for proc in cluster.procs.values():
                if proc.poll() is None:
                    proc.kill()
    assert KILLED == [KILL_AT_SYNC]
    assert trainer.result is not None and trainer.result.ok
    assert len(there["history"]) == len(here["history"]) == EPOCHS // SYNC
    for mine, theirs in zip(there["workers"], here["workers"], strict=True):
        for a, b in zip(mine.model.state_dict().values(), theirs.model.state_dict().values(), strict=True):
            assert torch.equal(a, b)  # weights and BatchNorm statistics alike
        assert torch.equal(mine.gen.get_state(), theirs.gen.get_state())
    assert accuracy(there["workers"][0]) == accuracy(here["workers"][0]) >= 0.95
