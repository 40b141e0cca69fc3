"""Local training functions that misbehave on purpose, for tests of the round policy.

Each wraps fedmq's own trainer; module-level knobs say when to misbehave (set by a test).
`gated` makes one client's training in one round wait for an event the test sets, so a test
orders what happens around it by events, never by how long something takes. In a learner
process (tests/e2e) FEDMQ_TEST_TRAIN_GATE names a file: every training waits until it exists,
except the first FEDMQ_TEST_TRAIN_GATE_AFTER trainings of the process (default 0).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from torch import nn

from fedmq.common.jobspec import TrainSpec
from fedmq.common.seeding import derive_seed
from fedmq.services.learner.training import train_local

FAIL_SIZE = [-1]  # `failing`: the shard size to fail on
SECONDS = [0.0]  # `slow`: seconds to sleep before training (a duration to outlast, not an order)
DEVICES: list[tuple[str, str]] = []  # `recording`: (device given, device of the trained weights)
GATE_TIMEOUT_S = 120.0  # long enough for any loaded machine; a bug fails here rather than hangs
_gates: dict[int, threading.Event] = {}  # by the seed of the training generator: (job seed, round, client)
_made: list[threading.Event] = []
_trainings = [0]  # trainings started in this process, for FEDMQ_TEST_TRAIN_GATE_AFTER
_lock = threading.Lock()


def gate(seed: int, server_round: int, client: int) -> threading.Event:
    """An event the first attempt to train `client` in `server_round` (job seed `seed`) waits for."""
    event = threading.Event()
    with _lock:
        _gates[derive_seed(seed, "train", server_round, client)] = event
        _made.append(event)
    return event


def failing(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainSpec,
    generator: torch.Generator, device: torch.device,
) -> dict[str, float]:
    if len(x) == FAIL_SIZE[0]:
        raise RuntimeError("simulated out-of-memory on this client")
    return train_local(model, x, y, train, generator, device)


def slow(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainSpec,
    generator: torch.Generator, device: torch.device,
) -> dict[str, float]:
    time.sleep(SECONDS[0])
    return train_local(model, x, y, train, generator, device)


def gated(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainSpec,
    generator: torch.Generator, device: torch.device,
) -> dict[str, float]:
    # The learner seeds the generator from (job seed, round, client): it names this training.
    with _lock:
        event = _gates.pop(generator.initial_seed(), None)  # a second attempt does not wait
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
    return train_local(model, x, y, train, generator, device)


def recording(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainSpec,
    generator: torch.Generator, device: torch.device,
) -> dict[str, float]:
    metrics = train_local(model, x, y, train, generator, device)
    with _lock:
        DEVICES.append((str(device), str(next(model.parameters()).device)))
    return metrics


def reset() -> None:
    FAIL_SIZE[0], SECONDS[0] = -1, 0.0
    DEVICES.clear()
    with _lock:
        for event in _made:
            event.set()  # nothing may stay blocked after its test
        _gates.clear()
        _made.clear()
