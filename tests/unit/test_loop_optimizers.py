"""The training loop's own SGD and Adam: torch.optim's steps, bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from fedmq.common.task.optimizers import Adam, Sgd


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-3), (0.0, 1e-2)])
def test_the_loops_sgd_takes_torch_optims_steps_bit_for_bit(momentum: float, weight_decay: float) -> None:
    torch.manual_seed(0)
    mine = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    theirs = copy.deepcopy(mine)
    mine[0].bias.requires_grad_(False)  # a frozen parameter: no gradient, left alone by both
    theirs[0].bias.requires_grad_(False)
    ours = Sgd(mine.parameters(), 0.05, momentum, weight_decay)
    torch_sgd = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    for step in range(5):
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        for model, opt in ((mine, ours), (theirs, torch_sgd)):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}"


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_the_loops_adam_takes_torch_optims_steps_bit_for_bit(weight_decay: float) -> None:
    torch.manual_seed(0)
    mine = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    theirs = copy.deepcopy(mine)
    ours = Adam(mine.parameters(), 0.01, weight_decay)
    torch_adam = torch.optim.Adam(theirs.parameters(), lr=0.01, weight_decay=weight_decay, foreach=False)
    for step in range(12):
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        # The last layer's bias sits out every third step: its own step count falls behind.
        skip = step % 3 == 2
        for model, opt in ((mine, ours), (theirs, torch_adam)):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            if skip:
                model[2].bias.grad = None
            opt.step()
        for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}"


@pytest.mark.parametrize("make", [
    lambda params: Sgd(params, 0.05, 0.9, 1e-3),
    lambda params: Adam(params, 0.01, 1e-2),
], ids=["sgd", "adam"])
def test_stepping_in_the_backward_pass_takes_the_same_steps_holding_one_gradient_at_a_time(make: Any) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 3))
    early = copy.deepcopy(plain)
    early[2].bias.requires_grad_(False)  # frozen: no gradient, no hook, left alone by both
    plain[2].bias.requires_grad_(False)
    params = [p for p in early.parameters() if p.requires_grad]
    held: list[int] = []  # gradients held when each arrives (a hook registered before the optimizer's)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: held.append(sum(q.grad is not None for q in params)))
    ours, theirs = make(early.parameters()), make(plain.parameters())
    for step in range(6):
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        theirs.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(plain(x), y).backward()
        theirs.step()
        with ours.in_backward():
            ours.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(early(x), y).backward()
            assert all(p.grad is None for p in early.parameters()), "each gradient dropped once used"
            ours.step()  # finds none: nothing more happens
        for a, b in zip(early.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}"
    assert held == [1] * (len(params) * 6)
    nn.functional.cross_entropy(early(torch.randn(2, 5)), torch.tensor([0, 1])).backward()
    assert all(p.grad is not None for p in params), "closed: the hooks are gone"


def test_a_second_gradient_in_one_backward_pass_fails_rather_than_step_twice() -> None:
    model = nn.Linear(3, 2)
    plain = copy.deepcopy(model)
    ours, theirs = Sgd(model.parameters(), 0.1, 0.0, 0.0), Sgd(plain.parameters(), 0.1, 0.0, 0.0)
    x = torch.ones(4, 3)
    with ours.in_backward():
        ours.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="second gradient in one backward pass"):
            loss.backward()  # as a backward() of the Task's own, or reentrant checkpointing, would
        ours.zero_grad()  # the next step starts afresh
        model(x).pow(2).sum().backward()
    for _ in range(2):  # two steps, never three
        theirs.zero_grad()
        plain(x).pow(2).sum().backward()
        theirs.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))


class _NoGradForWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w.detach().sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def test_a_parameter_a_custom_backward_gives_no_gradient_is_left_alone() -> None:
    w = nn.Parameter(torch.ones(3))
    x = torch.ones(2, requires_grad=True)
    ours = Sgd([w], 0.1, 0.0, 0.0)
    fired: list[torch.Tensor | None] = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad))
    with ours.in_backward():
        ours.zero_grad()
        _NoGradForWeight.apply(x, w).sum().backward()
    assert fired == [None], "torch calls the hook all the same"
    assert torch.equal(w, torch.ones(3))


def test_the_loops_backward_gives_the_gradients_of_backward_and_its_errors() -> None:
    from fedmq.common.task.loop import backward

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    x, y = torch.randn(11, 5), torch.randint(0, 3, (11,))
    grads = []
    for step in (lambda loss: loss.backward(), backward):
        model.zero_grad(set_to_none=True)
        step(torch.nn.functional.cross_entropy(model(x), y))
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[1]) == 4 and all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        backward(model(x).sum(dim=1))  # not a scalar: backward() itself says so
    with pytest.raises(RuntimeError, match="does not require grad"):
        backward(torch.ones(()))


def test_a_torch_function_mode_still_sees_the_loops_backward() -> None:
    from torch.overrides import TorchFunctionMode

    from fedmq.common.task.loop import backward

    seen: list[str] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    w = torch.ones(3, requires_grad=True)
    with Watch():
        backward((w * 2).sum())
    assert "backward" in seen and w.grad is not None and torch.equal(w.grad, torch.full((3,), 2.0))
