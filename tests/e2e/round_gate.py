"""A round limit for jobs of real processes: training for round r waits until the test allows r.

The test writes the gate folder: `rounds.json` maps each training's seed to its round (the
learner seeds the generator from (job seed, "train", round, client)), and `limit` holds the last
round allowed. A job under the gate stops in round limit + 1 with its tasks held by learners, so
a test knows exactly which round is in flight when it disturbs something. Without
FEDMQ_TEST_ROUND_GATE (the undisturbed run in the test process) training runs as usual.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from torch import nn

import fedmq
from fedmq.common.jobspec import JobSpec
from fedmq.common.seeding import derive_seed
from fedmq.common.task.loop import train_with_loss
from fedmq.tasks.digits import Digits

TASK = "tests.e2e.round_gate:RoundGated"
GATE_TIMEOUT_S = 300.0  # long enough for any loaded machine; a bug fails here rather than hangs


class RoundGate:
    """The test's side: say which rounds may train."""

    def __init__(self, folder: Path, spec: JobSpec) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        rounds = {
            str(derive_seed(spec.seed, "train", r, client)): r
            for r in range(1, spec.rounds + 1) for client in range(spec.clients.total)
        }
        (folder / "rounds.json").write_text(json.dumps(rounds))
        self.allow(0)

    def allow(self, last_round: int) -> None:
        """Let every round up to `last_round` train (atomically: a reader sees the old or the new)."""
        tmp = self.folder / "limit.tmp"
        tmp.write_text(str(last_round))
        tmp.replace(self.folder / "limit")


class RoundGated(Digits):
    """The digits Task, whose training waits for the round gate when FEDMQ_TEST_ROUND_GATE is set."""

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        folder = os.environ.get("FEDMQ_TEST_ROUND_GATE")
        if folder:
            rounds = json.loads((Path(folder) / "rounds.json").read_text())
            server_round = rounds[str(ctx.generator.initial_seed())]
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while int((Path(folder) / "limit").read_text()) < server_round:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"round {server_round} was never allowed in {GATE_TIMEOUT_S:.0f} s")
                time.sleep(0.05)  # polling a file another process writes
        return train_with_loss(self, model, data, ctx)
