"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II) in pieces: the server step against
NumPy, the strategy's bookkeeping of c and c_i, and the client's corrected loop against a
hand-written one on a linear model."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fedmq
from fedmq.common.errors import AggregationError, ConfigError
from fedmq.common.seeding import torch_generator
from fedmq.common.strategy.clients import ClientStore
from fedmq.common.strategy.contract import CLIENT_STATE, SCAFFOLD, made
from fedmq.common.strategy.loading import strategy_options
from fedmq.common.task.loop import train_with_loss
from fedmq.common.task.scaffold import Controls
from fedmq.common.usercode import UserCodeError
from fedmq.services.aggregator.kernels import scaffold_step
from fedmq.services.aggregator.rounds import write_client_states
from fedmq.services.aggregator.strategies.scaffold import Scaffold

CPU = torch.device("cpu")


# --- the server step ---------------------------------------------------------------------------


def paper_server(
    x: np.ndarray, c: np.ndarray, ys: Sequence[np.ndarray], dcs: Sequence[np.ndarray], eta_g: float, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1, lines 16-17 in float64: x + η_g·(1/|S|)Σ(y_i − x), c + (1/N)Σ Δc_i."""
    dx = sum(y - x for y in ys) / len(ys)
    dc = sum(dcs) / len(dcs)
    return x + eta_g * dx, c + len(ys) / n * dc


@settings(max_examples=40, deadline=None)
@given(
    clients=st.integers(1, 6), extra=st.integers(0, 5), eta_g=st.floats(0.1, 2.0),
    seed=st.integers(0, 2**31 - 1), first=st.booleans(),
)
def test_the_server_step_is_the_papers_formula(
    clients: int, extra: int, eta_g: float, seed: int, first: bool
) -> None:
    rng = np.random.default_rng(seed)
    x, c = rng.normal(size=(4, 3)), (np.zeros((4, 3)) if first else rng.normal(size=(4, 3)))
    ys = [rng.normal(size=(4, 3)) for _ in range(clients)]
    dcs = [rng.normal(size=(4, 3)) for _ in range(clients)]
    t = torch.from_numpy
    averaged = {"w": torch.stack([t(y) for y in ys]).mean(0)}
    averaged_delta = {"w": torch.stack([t(d) for d in dcs]).mean(0)}
    control_before = {} if first else {"w": t(c)}
    fraction = clients / (clients + extra)
    weights, control = scaffold_step({"w": t(x)}, averaged, control_before, averaged_delta, eta_g, fraction)
    want_x, want_c = paper_server(x, c, ys, dcs, eta_g, clients + extra)
    np.testing.assert_allclose(weights["w"].numpy(), want_x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(control["w"].numpy(), want_c, rtol=1e-12, atol=1e-12)


def test_the_server_step_gives_integer_buffers_the_mean_and_refuses_a_bad_fraction() -> None:
    current = {"w": torch.zeros(2), "count": torch.tensor(3)}
    averaged = {"w": torch.ones(2), "count": torch.tensor(5)}
    weights, _ = scaffold_step(current, averaged, {}, {"w": torch.ones(2)}, 0.5, 1.0)
    assert torch.equal(weights["count"], torch.tensor(5)) and torch.equal(weights["w"], torch.full((2,), 0.5))
    with pytest.raises(AggregationError, match=r"\|S\|/N"):
        scaffold_step(current, averaged, {}, {}, 1.0, 1.5)


# --- the strategy ------------------------------------------------------------------------------


def result(client: int, weights: Mapping[str, torch.Tensor], extras: Mapping[str, torch.Tensor]) -> Any:
    return fedmq.ClientResult(client, 10 + client, loader=lambda: weights, extras_loader=lambda: extras)


def context(server_round: int, stored: Mapping[int, Mapping[str, torch.Tensor]], n: int = 5) -> Any:
    return fedmq.RoundContext(round=server_round, rounds=5, seed=0, num_clients=n,
                              reader=lambda c: dict(stored.get(c, {})))


Tensors = dict[str, torch.Tensor]


def random_round(seed: int, clients: Sequence[int]) -> list[tuple[int, Tensors, Tensors]]:
    """Each client's (weights y_i, extras with its dc) for a round, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return [(c, {"w": draw(3, 2), "b": draw(2)}, {"dc.w": draw(3, 2)}) for c in clients]


def run_rounds(
    strategy: Scaffold, rounds: Sequence[Sequence[int]], start: int = 1,
    x: Tensors | None = None, stored: dict[int, Tensors] | None = None,
) -> tuple[Tensors, dict[int, Tensors], list[fedmq.Aggregate]]:
    """Rounds of the strategy with the aggregator's bookkeeping: each round's client and shared state kept."""
    x = x if x is not None else {k: torch.zeros_like(v) for k, v in random_round(0, [0])[0][1].items()}
    stored = {c: dict(s) for c, s in (stored or {}).items()}
    shared: dict[str, torch.Tensor] = {}
    outs = []
    for r, clients in enumerate(rounds, start):
        view = {c: {**shared, **stored.get(c, {})} for c in range(5)}
        results = [result(c, w, e) for c, w, e in random_round(r, clients)]
        out = strategy.aggregate(context(r, view), x, results, [])
        x = dict(out.weights)
        stored.update({c: dict(made(value)) for c, value in out.client_state.items()})
        shared = dict(out.shared_state)
        outs.append(out)
    return x, stored, outs


def test_the_strategy_keeps_c_i_per_client_and_c_as_the_mean_of_all_clients_controls() -> None:
    strategy = Scaffold(Scaffold.Options(eta_g=0.5))
    rounds = [[0, 1, 2], [1, 3], [0, 4]]
    x, stored, outs = run_rounds(strategy, rounds)
    sums: dict[int, torch.Tensor] = {}
    c = torch.zeros(3, 2, dtype=torch.float64)
    xw = torch.zeros(3, 2, dtype=torch.float64)
    for r, clients in enumerate(rounds, 1):
        got = random_round(r, clients)
        for client, _, extras in got:
            sums[client] = sums.get(client, torch.zeros(3, 2, dtype=torch.float64)) + extras["dc.w"]
        c = c + sum(e["dc.w"] for _, _, e in got) / 5
        xw = xw + 0.5 * (torch.stack([w["w"] for _, w, _ in got]).mean(0) - xw)
    for client, total in sums.items():
        torch.testing.assert_close(stored[client]["c_i.w"], total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs[-1].shared_state["c.w"], c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum(s["c_i.w"] for s in stored.values()) / 5, c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x["w"], xw, rtol=1e-12, atol=1e-12)
    assert set(stored[3]) == {"c_i.w"} and set(outs[-1].shared_state) == {"c.w"}, "controls only where sent"
    assert strategy.state() == {"c.w": outs[-1].shared_state["c.w"]}
    assert outs[-1].metrics["control_norm"] == pytest.approx(float(c.norm()))


def test_a_strategy_restored_from_its_state_goes_on_as_the_undisturbed_one() -> None:
    rounds = [[0, 1, 2], [1, 3], [0, 4], [2, 3]]
    whole = run_rounds(Scaffold(), rounds)
    first = Scaffold()
    x, stored, _ = run_rounds(first, rounds[:2])
    restored = Scaffold()
    restored.load_state({k: v.clone() for k, v in first.state().items()})
    resumed = run_rounds(restored, rounds[2:], start=3, x=x, stored=stored)
    assert all(torch.equal(resumed[0][k], whole[0][k]) for k in whole[0])
    assert all(torch.equal(resumed[1][c][k], whole[1][c][k]) for c in whole[1] for k in whole[1][c])
    assert resumed[2][-1].metrics == whole[2][-1].metrics


def test_the_strategy_asks_for_scaffold_and_the_clients_state_every_round() -> None:
    assert Scaffold().configure(context(1, {})) == {SCAFFOLD: True}
    assert Scaffold.sends_client_state and CLIENT_STATE not in Scaffold().configure(context(1, {}))
    assert strategy_options("scaffold", {}) == Scaffold.Options(eta_g=1.0)
    with pytest.raises(ConfigError, match="eta_g"):
        strategy_options("scaffold", {"eta_g": 0})


def test_an_update_without_control_deltas_or_with_wrong_ones_is_an_error_naming_the_client() -> None:
    x = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    w = {"w": torch.ones(3, 2), "b": torch.ones(2)}
    with pytest.raises(AggregationError, match="client 2 sent no control deltas"):
        Scaffold().aggregate(context(1, {}), x, [result(2, w, {})], [])
    with pytest.raises(AggregationError, match=r"client 1's dc.w matches no floating parameter"):
        Scaffold().aggregate(context(1, {}), x, [result(1, w, {"dc.w": torch.ones(2, 3)})], [])
    with pytest.raises(AggregationError, match="different parameters"):
        Scaffold().aggregate(context(1, {}), x, [result(0, w, {"dc.w": torch.ones(3, 2)}),
                                                  result(1, w, {"dc.b": torch.ones(2)})], [])


class Counted(Mapping[str, torch.Tensor]):
    """A client's lazy extras: each lookup makes a fresh tensor, counted while it is alive."""

    alive: ClassVar[dict[int, int]] = {}  # client -> its tensors alive now
    most: ClassVar[int] = 0  # the most clients with a tensor alive at once

    def __init__(self, client: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.client, self.tensors = client, tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name].clone()
        Counted.alive[self.client] = Counted.alive.get(self.client, 0) + 1
        Counted.most = max(Counted.most, sum(1 for n in Counted.alive.values() if n))
        weakref.finalize(tensor, Counted.dropped, self.client)
        return tensor

    @staticmethod
    def dropped(client: int) -> None:
        Counted.alive[client] -= 1

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def test_a_round_holds_one_clients_control_deltas_at_a_time_however_many_clients(tmp_path: Path) -> None:
    clients = list(range(12))
    x = {k: torch.zeros_like(v) for k, v in random_round(0, [0])[0][1].items()}
    results = [
        fedmq.ClientResult(
            c, 10, loader=functools.partial(dict, w), extras_loader=functools.partial(Counted, c, e)
        )
        for c, w, e in random_round(1, clients)
    ]
    store = ClientStore(tmp_path)
    Counted.alive.clear()
    Counted.most = 0
    out = Scaffold().aggregate(context(1, {}, n=12), x, results, [])
    written = write_client_states(store, 1, out.client_state, out.shared_state)
    assert written == clients and store.clients() == clients
    # One client's deltas, and the last tensor read of the client before (the fold's loop variable).
    assert Counted.most <= 2, f"the deltas of {Counted.most} clients were alive together"
    assert not any(Counted.alive.values())
    want = {c: e["dc.w"] for c, _, e in random_round(1, clients)}
    assert all(torch.equal(store.read(c, before=2)["c_i.w"], want[c]) for c in clients)


def test_the_aggregator_makes_and_writes_lazy_client_states_one_at_a_time(tmp_path: Path) -> None:
    alive: list[int] = []
    most = 0

    def make(client: int) -> dict[str, torch.Tensor]:
        nonlocal most
        state = {"s": torch.full((4,), float(client))}
        alive.append(client)
        most = max(most, len(alive))
        weakref.finalize(state["s"], alive.remove, client)
        return state

    lazy = {c: functools.partial(make, c) for c in (5, 1, 3)}
    assert write_client_states(ClientStore(tmp_path), 2, lazy, {}) == [1, 3, 5]
    assert most == 1 and not alive
    assert ClientStore(tmp_path).read(3, before=3)["s"].tolist() == [3.0] * 4


def test_a_lazy_client_state_that_raises_is_the_strategys_error() -> None:
    def broken() -> dict[str, torch.Tensor]:
        raise KeyError("c_i.w")

    with pytest.raises(UserCodeError, match="strategy.aggregate raised KeyError"):
        write_client_states(ClientStore(Path("/nonexistent")), 1, {0: broken}, {})
    with pytest.raises(UserCodeError, match="keyed by client id"):
        write_client_states(ClientStore(Path("/nonexistent")), 1, {"zero": {}}, {})  # type: ignore[dict-item]


# --- the client: fedmq's loop with the controls --------------------------------------------------


class Linear(fedmq.Task):
    def build_model(self) -> nn.Module:
        return nn.Linear(3, 2)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return (model(x) - y).pow(2).mean()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)


def linear_model(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def controls(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{prefix}{name}": torch.randn(shape, generator=g) * 0.3
            for prefix in ("c.", "c_i.") for name, shape in (("weight", (2, 3)), ("bias", (2,)))}


def train(model: nn.Module, state: Mapping[str, torch.Tensor], scaffold: bool = True,
          **settings: Any) -> fedmq.TrainResult:
    """Full-batch training (one step per epoch) with fedmq's loop."""
    global_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ctx = fedmq.TrainContext(
        client=0, round=1, seed=0, device=CPU,
        train=fedmq.TrainSettings(**{"epochs": 4, "batch_size": 8, "lr": 0.1, **settings}),
        generator=torch_generator(0, "train", 1, 0), global_weights=global_weights,
        config={SCAFFOLD: True} if scaffold else {}, client_state=state,
    )
    return train_with_loss(Linear(), model, data(), ctx)


def hand_loop(w: np.ndarray, b: np.ndarray, state: Mapping[str, torch.Tensor], steps: int, lr: float
              ) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """y ← y − lr·(g(y) − c_i + c) with the MSE gradient written out, in float64; the gradients seen."""
    x, t = (a.double().numpy() for a in data())
    n = {k: v.double().numpy() for k, v in state.items()}
    grads = []
    for _ in range(steps):
        r = x @ w.T + b - t  # (8, 2)
        gw, gb = 2 * r.T @ x / r.size, 2 * r.sum(0) / r.size
        grads.append((gw, gb))
        w = w - lr * (gw - n["c_i.weight"] + n["c.weight"])
        b = b - lr * (gb - n["c_i.bias"] + n["c.bias"])
    return w, b, grads


@pytest.mark.parametrize("max_steps", [None, 3])
def test_the_loops_corrected_steps_and_control_update_are_the_papers(max_steps: int | None) -> None:
    model, state = linear_model(), controls(1)
    w0, b0 = (p.detach().double().numpy().copy() for p in (model.weight, model.bias))
    result = train(model, state, max_steps=max_steps)
    steps = max_steps or 4
    w, b, grads = hand_loop(w0, b0, state, steps, 0.1)
    np.testing.assert_allclose(model.weight.detach().numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.bias.detach().numpy(), b, rtol=1e-5, atol=1e-6)
    assert set(result.extras) == {"dc.weight", "dc.bias"}
    for name, start, end, k in (("weight", w0, w, 0), ("bias", b0, b, 1)):
        c, c_i = state[f"c.{name}"].double().numpy(), state[f"c_i.{name}"].double().numpy()
        new_c_i = c_i + result.extras[f"dc.{name}"].double().numpy()
        # option II: c_i⁺ = c_i − c + (x − y)/(K·lr), which for plain SGD is the mean gradient seen
        np.testing.assert_allclose(new_c_i, c_i - c + (start - end) / (steps * 0.1), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(new_c_i, np.mean([g[k] for g in grads], axis=0), rtol=1e-4, atol=1e-5)


def test_zero_controls_train_exactly_as_the_plain_loop_and_a_first_round_sends_none() -> None:
    plain, corrected = linear_model(), linear_model()
    zeros = {k: torch.zeros_like(v) for k, v in controls(0).items()}
    assert train(plain, {}, scaffold=False).extras == {}
    first = train(corrected, {})
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), corrected.parameters(), strict=True))
    again = linear_model()
    assert torch.equal(train(again, zeros).extras["dc.weight"], first.extras["dc.weight"])


@pytest.mark.parametrize(("settings", "said"), [({"optimizer": "adam"}, "adam"), ({"momentum": 0.9}, "0.9")])
def test_the_loop_refuses_anything_but_plain_sgd_steps(settings: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError, match=f"SCAFFOLD \\(option II\\) needs plain SGD steps.*{said}"):
        train(linear_model(), {}, **settings)


def test_controls_of_the_wrong_shape_are_refused_naming_them() -> None:
    state = {**controls(0), "c.bias": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"c.bias has shape \(3,\)"):
        train(linear_model(), state)


def test_a_parameter_the_loss_does_not_use_still_takes_the_correction() -> None:
    model = nn.Linear(3, 2)
    unused = nn.Parameter(torch.zeros(2))
    model.register_parameter("unused", unused)
    state = {"c.unused": torch.ones(2), "c_i.unused": torch.zeros(2)}
    ctrl = Controls(model, {k: v.detach().clone() for k, v in model.named_parameters()}, state, lr=0.5)
    ctrl.correct()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    assert torch.equal(unused.detach(), torch.full((2,), -0.5))
    torch.testing.assert_close(ctrl.extras()["dc.unused"], torch.zeros(2))  # mean gradient 0: c_i⁺ = 0


def test_a_task_with_its_own_train_finds_the_controls_on_fedmq() -> None:
    assert fedmq.Controls is Controls and "Controls" in fedmq.__all__
