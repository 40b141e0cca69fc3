"""Tasks that misbehave on purpose, for tests of the round policy: the digits Task with a
`train` that fails, waits, records or is gated before it runs fedmq's own loop.

Module-level knobs say when to misbehave (set by a test). `Gated` makes one client's
training in one round wait for an event the test sets, so a test orders what happens around
it by events, never by how long something takes. In a learner process (tests/e2e)
FEDMQ_TEST_TRAIN_GATE names a file: every training waits until it exists, except the first
FEDMQ_TEST_TRAIN_GATE_AFTER trainings of the process (default 0).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fedmq
from fedmq.common.seeding import derive_seed
from fedmq.common.task.loop import train_with_loss
from fedmq.tasks.digits import Digits

FAIL_SIZE = [-1]  # `Failing`: the shard size to fail on
SECONDS = [0.0]  # `Slow`: seconds to sleep before training (a duration to outlast, not an order)
DEVICES: list[tuple[str, str]] = []  # `Recording`: (device given, device of the trained weights)
GATE_TIMEOUT_S = 120.0  # long enough for any loaded machine; a bug fails here rather than hangs
_gates: dict[int, threading.Event] = {}  # by the seed of the training generator: (job seed, round, client)
_made: list[threading.Event] = []
_trainings = [0]  # `Gated` trainings in this process
_lock = threading.Lock()


def gate(seed: int, server_round: int, client: int) -> threading.Event:
    """An event the first attempt to train `client` in `server_round` (job seed `seed`) waits for."""
    event = threading.Event()
    with _lock:
        _gates[derive_seed(seed, "train", server_round, client)] = event
        _made.append(event)
    return event


class Failing(Digits):
    """Raises in training on the client whose shard has FAIL_SIZE examples."""

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        if len(data[1]) == FAIL_SIZE[0]:
            raise RuntimeError("simulated out-of-memory on this client")
        return train_with_loss(self, model, data, ctx)


class Broken(Digits):
    """Raises in every training: user code that is simply wrong."""

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        raise RuntimeError("simulated out-of-memory in every client")


class Slow(Digits):
    """Sleeps SECONDS before training."""

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        time.sleep(SECONDS[0])
        return train_with_loss(self, model, data, ctx)


class Gated(Digits):
    """Waits for the gate of its (round, client), if a test made one (see the module docstring)."""

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        # The learner seeds the generator from (job seed, round, client): it names this training.
        with _lock:
            event = _gates.pop(ctx.generator.initial_seed(), None)  # a second attempt does not wait
        if event is not None and not event.wait(GATE_TIMEOUT_S):
            raise RuntimeError(f"the test never opened this training's gate in {GATE_TIMEOUT_S:.0f} s")
        with _lock:
            _trainings[0] += 1
            free = _trainings[0] <= int(os.environ.get("FEDMQ_TEST_TRAIN_GATE_AFTER", "0"))
        gate_file = os.environ.get("FEDMQ_TEST_TRAIN_GATE")
        if gate_file and not free:
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while not Path(gate_file).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{gate_file} did not appear in {GATE_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        return train_with_loss(self, model, data, ctx)


class WithMargin(Digits):
    """Digits reporting a metric of its own: the mean margin of the true class's logit over the next."""

    def loss(self, model: nn.Module, batch: Any) -> tuple[Any, dict[str, Any]]:
        loss, metrics = super().loss(model, batch)
        logits, y = model(batch[0]).detach(), batch[1]
        true = logits.gather(1, y[:, None])[:, 0]
        other = logits.scatter(1, y[:, None], float("-inf")).max(dim=1).values
        return loss, {**metrics, "margin": (true - other).mean()}


class Recording(Digits):
    """Records the device it was given and the device its weights ended on."""

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        result = train_with_loss(self, model, data, ctx)
        with _lock:
            DEVICES.append((str(ctx.device), str(next(model.parameters()).device)))
        return result


def reset() -> None:
    FAIL_SIZE[0], SECONDS[0] = -1, 0.0
    DEVICES.clear()
    with _lock:
        for event in _made:
            event.set()  # nothing may stay blocked after its test
        _gates.clear()
        _made.clear()


class Visits(Digits):
    """Keeps each client's own state between its rounds (Task.keeps_state): how many times it
    trained (an int), the rounds it trained in (a tensor), a bool and a float, each checked to come
    back as it was left; fedmq's loop keeps its optimizer's state there too (the spec's
    train.keep_optimizer_state). Reports `visits` (the round's most) and `kept_right`."""

    keeps_state = True
    metric_reduction = {"visits": "max", "kept_right": "min"}

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        state = ctx.state
        visits = state.get("visits", 0)
        seen = state.get("rounds", torch.zeros(0, dtype=torch.int64))
        right = (isinstance(visits, int) and not isinstance(visits, bool) and len(seen) == visits
                 and (visits == 0 or (state.get("warm") is True and state.get("scale") == 0.5)))
        state.update(visits=visits + 1, rounds=torch.cat([seen, torch.tensor([ctx.round])]), warm=True,
                     scale=0.5)
        result = train_with_loss(self, model, data, ctx)
        metrics = {**result.metrics, "visits": float(visits + 1), "kept_right": float(right)}
        return fedmq.TrainResult(result.num_examples, metrics, result.extras)
