"""A client's own state between rounds: its encoding as update entries, and the loop's optimizer.

The loop's optimizer state kept in ctx.state must make two rounds of training the same, bit for
bit, as one torch.optim optimizer living through both (the model carried over, as a client's
personal model would be); without it the second round starts afresh and lands elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fedmq.common.task.contract import Task, TrainContext, TrainSettings
from fedmq.common.task.loop import train_with_loss
from fedmq.common.task.state import check_state_entries, state_entries, state_of


def test_a_clients_state_comes_back_as_it_was_left() -> None:
    state: dict[str, Any] = {"moments": torch.arange(6.0).reshape(2, 3), "seen": 3, "lr": 0.125, "warm": True,
             "cold": False, "big": 2**40}
    back = state_of(state_entries(state))
    assert back.keys() == state.keys()
    assert torch.equal(back["moments"], state["moments"])
    for name in ("seen", "lr", "warm", "cold", "big"):
        assert back[name] == state[name] and type(back[name]) is type(state[name]), name
    check_state_entries(state_entries(state), limit_bytes=1 << 12)


@pytest.mark.parametrize(("value", "said"), [([1, 2], "a list"), ("text", "a str"), (None, "a NoneType")])
def test_a_value_a_state_cannot_keep_is_named(value: Any, said: str) -> None:
    with pytest.raises(TypeError, match=rf"ctx.state\['x'\] is {said}: a client's state keeps tensors"):
        state_entries({"x": value})


@pytest.mark.parametrize(("entries", "said"), [
    ({"fedmq.state.q.x": torch.tensor(1)}, "is no client state entry"),
    ({"fedmq.state.i.x": torch.tensor([1, 2])}, "must be a 0-d torch.int64"),
    ({"fedmq.state.f.x": torch.tensor(1.0)}, "must be a 0-d torch.float64"),
    ({"fedmq.state.t.x": torch.zeros(300)}, "over its limit of 1024"),
    ({f"fedmq.state.t.x{i}": torch.zeros(0, 10**9) for i in range(5)}, "over its limit"),  # empty ones
    ({"fedmq.state.t.a/b": torch.zeros(1)}, "is no client state entry"),
    ({"fedmq.state.t.x": torch.tensor([float("nan")])}, "holds NaN, infinity or complex values"),
    ({"fedmq.state.t.x": torch.zeros(1, dtype=torch.complex64)}, "holds NaN, infinity or complex values"),
])
def test_entries_a_learner_did_not_make_are_refused(entries: dict[str, torch.Tensor], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        check_state_entries(entries, limit_bytes=1024)


class Line(Task):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def load_data(self, ctx: Any) -> Any:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x).squeeze(1), y)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(40, 4, generator=g), torch.randn(40, generator=g)


SETTINGS: dict[str, dict[str, Any]] = {
    "sgd-momentum": dict(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": dict(optimizer="adam", lr=0.01),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "afresh"])
def test_the_loops_optimizer_state_kept_between_rounds_is_one_optimizer_throughout(
    name: str, keep: bool
) -> None:
    task, (x, y) = Line(), data()
    torch.manual_seed(0)
    mine = task.build_model()
    theirs = task.build_model()
    theirs.load_state_dict(mine.state_dict())
    settings = TrainSettings(epochs=2, batch_size=8, keep_optimizer_state=keep, **SETTINGS[name])
    state: dict[str, Any] = {}
    for server_round in (1, 2):
        ctx = TrainContext(client=0, round=server_round, seed=0, train=settings, device=torch.device("cpu"),
                           generator=torch.Generator().manual_seed(server_round), global_weights={},
                           state=state)
        train_with_loss(task, mine, (x, y), ctx)
        state = state_of(state_entries(ctx.state))  # as it travels to the aggregator and back
    assert bool(state) == keep
    options = SETTINGS[name]
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(theirs.parameters(), lr=options["lr"]) if options["optimizer"] == "adam"
        else torch.optim.SGD(theirs.parameters(), lr=options["lr"], momentum=options["momentum"],
                             weight_decay=options["weight_decay"]))
    for server_round in (1, 2):
        g = torch.Generator().manual_seed(server_round)
        for _ in range(2):
            for batch in torch.randperm(40, generator=g).split(8):
                opt.zero_grad()
                nn.functional.mse_loss(theirs(x[batch]).squeeze(1), y[batch]).backward()
                opt.step()
    same = all(torch.equal(a, b) for a, b in zip(mine.parameters(), theirs.parameters(), strict=True))
    assert same == keep, "kept: one optimizer throughout, bit for bit; afresh: the second round differs"
