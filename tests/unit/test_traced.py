"""Recorded fused steps (common/task/traced.py): replays give an eager step's bits, and when."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from fedmq.common.task import traced
from fedmq.common.task.contract import DpSgd, TrainSettings
from fedmq.common.task.fused import train_fused
from tests.unit.test_fused import NORM_SIZES, SETTINGS, SIZES, Mlp, Tied, clients, contexts, model_for


def rounds_of(
    task: Mlp, settings: TrainSettings, sizes: list[int], rounds: int
) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Every client's weights (and buffers) after each of `rounds` fused rounds from the same start
    (a fresh model), and how many recorded layouts passed their check."""
    model, out = model_for(task), []
    for r in range(rounds):
        if isinstance(task, Scaled):
            task.scale = 1.0 + r  # a number the loss reads changes between rounds
        ctxs = [dataclasses.replace(ctx, private_seed=7_000 + ctx.client)
                for ctx in contexts(model, len(sizes), settings)]  # DP-SGD's secret seeds (else unused)
        fused = train_fused(task, model, clients(sizes), ctxs)
        assert fused is not None
        out += [one.weights for one in fused]
    entries = traced._BY_MODEL[model].entries.values() if model in traced._BY_MODEL else []
    return out, sum(isinstance(entry, traced._Replay) and entry.checked for entry in entries)


class Scaled(Mlp):
    scale = 1.0

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        loss, metrics = super().loss(model, batch)
        return loss * self.scale, metrics


@pytest.mark.parametrize("case", ["sgd", "adam", "summed", "tied", "batchnorm", "dp-sgd", "task-number"])
def test_replayed_steps_train_to_the_bits_of_eager_ones(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    task = (Tied() if case == "tied" else Scaled() if case == "task-number"
            else Mlp(summed=case == "summed", norm=case == "batchnorm"))
    settings = SETTINGS["adam" if case == "adam" else "sgd"]
    if case == "dp-sgd":
        settings = dataclasses.replace(settings, dp_sgd=DpSgd(clip_norm=0.5, noise_multiplier=0.8))
    sizes = NORM_SIZES if case == "batchnorm" else SIZES
    with monkeypatch.context() as eager:
        eager.setattr(traced, "RECORD_AT", 10**9)
        expected, none = rounds_of(task, settings, sizes, 3)
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    got, recorded = rounds_of(task, settings, sizes, 3)
    assert none == 0 and recorded > 0
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[n], theirs[n]) for n in mine)


def test_a_fused_round_replays_once_its_layouts_came_before() -> None:
    task = Mlp()
    model = model_for(task)
    for _ in range(3):
        train_fused(task, model, clients(), contexts(model, len(clients()), SETTINGS["sgd"]))
    recordings = traced._BY_MODEL[model]
    assert recordings.graphs > 0
    assert any(isinstance(entry, traced._Replay) and entry.checked for entry in recordings.entries.values())


class Counted:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        self.calls += 1
        return {"sum": x @ y + 1, "tanh": torch.tanh(x).sum(0)}


def test_a_layout_is_recorded_at_its_second_sighting_checked_at_its_third_and_replayed_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    owner, fn = nn.Linear(1, 1), Counted()
    x, y = torch.randn(4, 3), torch.randn(3, 2)
    outs = [traced.replayed(owner, "f", fn, x * k, y) for k in range(6)]
    # eager; recorded (on copies) and eager; checked against eager; then three replays
    assert fn.calls == 1 + 2 + 1
    for k, out in enumerate(outs):
        assert all(torch.equal(out[name], fn(x * k, y)[name]) for name in out)
    fn.calls = 0
    traced.replayed(owner, "f", fn, torch.randn(5, 3), y)  # another shape: seen once, eager
    traced.replayed(owner, "f", fn, x.t().contiguous().t(), y)  # other strides: another layout too
    assert fn.calls == 2


class Stale:
    """Reads a Python number into a tensor of its own: a recording bakes the first one in."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tensor(float(self.calls))


def test_a_recording_that_bakes_in_a_changing_value_fails_its_check_and_stays_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    owner, fn = nn.Linear(1, 1), Stale()
    x = torch.zeros(3)
    got = [float(traced.replayed(owner, "f", fn, x)[0]) for _ in range(5)]
    # eager (call 1); recorded (2) and eager (3); checked: eager on copies (4) differs from the
    # replay's baked-in 2, so eager's answer; eager from then on
    assert got == [1.0, 3.0, 4.0, 5.0, 6.0]
    assert list(traced._BY_MODEL[owner].entries.values()) == [None]
    assert traced._BY_MODEL[owner].graphs == 0


def test_a_function_that_fails_stays_eager_and_raises_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    owner = nn.Linear(1, 1)

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("no rule for this")

    for _ in range(3):
        with pytest.raises(ValueError, match="no rule"):
            traced.replayed(owner, "f", broken, torch.ones(2))
    assert list(traced._BY_MODEL[owner].entries.values()) == [None]


def test_past_max_graphs_new_layouts_stay_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traced, "MAX_GRAPHS", 1)
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    owner, fn = nn.Linear(1, 1), Counted()
    y = torch.randn(3, 2)
    for rows in (4, 5):
        for _ in range(3):
            traced.replayed(owner, "f", fn, torch.randn(rows, 3), y)
    assert traced._BY_MODEL[owner].graphs == 1
    assert fn.calls == 4 + 3  # the first layout recorded and checked, the second eager every time


def test_a_function_that_draws_random_numbers_stays_eager_and_draws_as_eager_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    owner = nn.Linear(1, 1)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(3)

    torch.manual_seed(11)
    got = [traced.replayed(owner, "f", noisy, torch.zeros(3)) for _ in range(4)]
    torch.manual_seed(11)
    expected = [noisy(torch.zeros(3)) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert list(traced._BY_MODEL[owner].entries.values()) == [None]


def test_a_function_that_changes_a_tensor_of_its_own_stays_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    owner, ceiling = nn.Linear(1, 1), torch.tensor([5.0, 5.0, 5.0])

    def clamped(x: torch.Tensor) -> torch.Tensor:
        ceiling.clamp_(max=x.max())  # written in place: a replay would write it again, from then on
        return x + ceiling

    inputs = [torch.full((3,), float(v)) for v in (4, 3, 6, 2, 7)]
    got = [traced.replayed(owner, "f", clamped, x) for x in inputs]
    ceiling.fill_(5.0)
    expected = [clamped(x) for x in inputs]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert list(traced._BY_MODEL[owner].entries.values()) == [None]


def test_a_function_that_returns_a_tensor_of_its_own_stays_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    owner, table = nn.Linear(1, 1), torch.zeros(3)

    def lookup(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, table  # the caller may change what it gets

    for _ in range(3):
        traced.replayed(owner, "f", lookup, torch.ones(3))
    assert list(traced._BY_MODEL[owner].entries.values()) == [None]


def test_running_statistics_a_batch_norm_writes_are_never_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    owner = nn.Linear(1, 1)

    def normed(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        nn.functional.batch_norm(x, mean, var, training=True)  # its output unused; its statistics not
        return x * 2

    mean, var = torch.zeros(4), torch.ones(4)
    eager_mean, eager_var = mean.clone(), var.clone()
    for step in range(5):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        traced.replayed(owner, "f", normed, x, mean, var)
        normed(x, eager_mean, eager_var)
    assert torch.equal(mean, eager_mean) and torch.equal(var, eager_var)
    assert any(isinstance(e, traced._Replay) and e.checked for e in traced._BY_MODEL[owner].entries.values())


def test_a_failed_check_leaves_the_inputs_as_eager_left_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traced, "RECORD_AT", 2)
    owner, fn = nn.Linear(1, 1), Stale()

    def bumped(x: torch.Tensor) -> torch.Tensor:
        x.add_(fn(torch.zeros(1)))  # in place, by a number the recording bakes in
        return x.sum()

    x = torch.zeros(1)
    for _ in range(4):
        traced.replayed(owner, "f", bumped, x)
    # eager adds 1; recording (on a copy) takes call 2, eager adds 3; the check's eager run (on a
    # copy) adds 4 where the replay added the baked-in 2: x takes the copy's; then eager adds 5
    assert float(x) == 1 + 3 + 4 + 5
    assert list(traced._BY_MODEL[owner].entries.values()) == [None]
