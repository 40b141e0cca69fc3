"""A user's strategy and Task written only against the public contract, for tests of the Strategy interface.

`Counting` counts, per client, the rounds it trained in, with state going both ways:

    aggregator ──client_state {"count": n}──▶ learner (CountingDigits.train) ──extras {"count": n+1}──▶

It averages like FedAvg, keeps a server counter in `state()` (so a restart must restore it),
and reports metrics of its own: the most rounds any client of the round has trained, clients
whose count disagrees with the stored one (0 when state travels right), the round's failures,
and its server counter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pydantic
import torch
from torch import nn

import fedmq
from fedmq.common.task.loop import train_with_loss
from fedmq.services.aggregator.strategies.fedavg import FedAvg
from fedmq.tasks.digits import Digits


class Counting(fedmq.Strategy):
    class Options(fedmq.StrategyOptions):
        scale: float = 1.0  # multiplies the reported max_count: an option the tests can set

    options: Options
    sends_client_state = True
    expected_extras = frozenset({"count"})

    def __init__(self, options: Options | None = None) -> None:
        super().__init__(options)
        self.rounds = torch.zeros((), dtype=torch.int64)

    def configure(self, ctx: fedmq.RoundContext) -> dict[str, float | int | str | bool]:
        return {"counting_round": ctx.round}

    def aggregate(
        self,
        ctx: fedmq.RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[fedmq.ClientResult],
        failures: Sequence[fedmq.ClientFailed],
    ) -> fedmq.Aggregate:
        total = sum(r.num_examples for r in results)
        new = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in current.items()}
        counts: dict[int, dict[str, torch.Tensor]] = {}
        mismatched = 0
        for r in results:
            for name, w in r.load().items():
                new[name] += w.to(torch.float64) * (r.num_examples / total)
            count = r.load_extras()["count"]
            before = ctx.client_state(r.client).get("count", torch.zeros(1))
            mismatched += int(not torch.equal(count, before + 1))
            counts[r.client] = {"count": count.clone()}
        self.rounds += 1
        weights = {k: v.round() if not current[k].is_floating_point() else v for k, v in new.items()}
        metrics = {
            "max_count": self.options.scale * max(float(c["count"].item()) for c in counts.values()),
            "mismatched": float(mismatched),
            "failed": float(len(failures)),
            "server_rounds": float(self.rounds.item()),
        }
        return fedmq.Aggregate({k: v.to(current[k].dtype) for k, v in weights.items()}, metrics, counts)

    def state(self) -> dict[str, torch.Tensor]:
        return {"rounds": self.rounds.clone()}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.rounds = state["rounds"].clone() if "rounds" in state else torch.zeros((), dtype=torch.int64)


class CountingDigits(Digits):
    """The digits Task, trained by fedmq's loop, adding one to the count the strategy sent."""

    def train(self, model: nn.Module, data: object, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        if ctx.config.get("counting_round") != ctx.round:
            raise ValueError(f"round config {dict(ctx.config)} is not round {ctx.round}'s")
        result = train_with_loss(self, model, data, ctx)
        count = ctx.client_state.get("count", torch.zeros(1)).cpu() + 1
        return fedmq.TrainResult(result.num_examples, result.metrics, extras={"count": count})


def expected_counts(samples: Sequence[Sequence[int]]) -> list[float]:
    """The max_count each round should report, from the clients sampled in rounds 1, 2, ..."""
    seen: dict[int, int] = {}
    out = []
    for clients in samples:
        for c in clients:
            seen[c] = seen.get(c, 0) + 1
        out.append(float(max(seen[c] for c in clients)))
    return out


PROX_SEEN: list[tuple[int, float, bool]] = []  # `ProxRecording`: (round, mu, global weights given)


class ProxRecording(Digits):
    """The digits Task with its own train applying FedProx's term from ctx.config, recording what it got."""

    def train(self, model: nn.Module, data: object, ctx: fedmq.TrainContext) -> fedmq.TrainResult:
        mu = float(ctx.config.get("proximal_mu", 0.0))
        PROX_SEEN.append((ctx.round, mu, set(ctx.global_weights) == set(model.state_dict())))
        return train_with_loss(self, model, data, ctx)  # fedmq's loop adds the term from ctx.config


class FailsInRound2(fedmq.Strategy):
    """Averages plainly, then raises when closing round 2: a user's bug, to fail the job by."""

    def aggregate(
        self,
        ctx: fedmq.RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[fedmq.ClientResult],
        failures: Sequence[fedmq.ClientFailed],
    ) -> fedmq.Aggregate:
        if ctx.round == 2:
            raise ZeroDivisionError("the user's bug")
        return fedmq.Aggregate(dict(results[0].load()))


class SeesFailures(FedAvg):
    """FedAvg that reports the round's failures: how many, how many in `train`, and which client."""

    def aggregate(
        self,
        ctx: fedmq.RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[fedmq.ClientResult],
        failures: Sequence[fedmq.ClientFailed],
    ) -> fedmq.Aggregate:
        out = super().aggregate(ctx, current, results, failures)
        in_train = [f for f in failures if f.phase == "train" and "out-of-memory" in f.reason]
        out.metrics = {
            "failed": float(len(failures)),
            "failed_in_train": float(len(in_train)),
            "failed_client": float(failures[0].client) if failures else -1.0,
        }
        return out


class Steady(fedmq.Strategy):
    """Leaves the weights as they are and counts the rounds in its state: the same weights every round
    with a state that moves on, so each round's checkpoint differs from the last only in its state."""

    def __init__(self, options: fedmq.StrategyOptions | None = None) -> None:
        super().__init__(options)
        self.rounds = torch.zeros((), dtype=torch.int64)

    def aggregate(
        self,
        ctx: fedmq.RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[fedmq.ClientResult],
        failures: Sequence[fedmq.ClientFailed],
    ) -> fedmq.Aggregate:
        self.rounds += 1
        return fedmq.Aggregate({k: v.clone() for k, v in current.items()})

    def state(self) -> dict[str, torch.Tensor]:
        return {"rounds": self.rounds.clone()}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.rounds = state["rounds"].clone() if "rounds" in state else torch.zeros((), dtype=torch.int64)


class NonFinite(fedmq.Strategy):
    """Averages nothing: returns the current weights, with a NaN where its option says (a user's bug)."""

    class Options(fedmq.StrategyOptions):
        where: str = "weights"  # weights, state, client_state or shared_state

    options: Options
    sends_client_state = True

    def aggregate(
        self,
        ctx: fedmq.RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[fedmq.ClientResult],
        failures: Sequence[fedmq.ClientFailed],
    ) -> fedmq.Aggregate:
        nan = {"x": torch.tensor([1.0, float("nan")])}
        self.aggregated = True
        weights = {k: v.clone() for k, v in current.items()}
        if self.options.where == "weights":
            first = next(k for k, v in weights.items() if v.is_floating_point())
            weights[first] = weights[first] / 0.0
        client_state = {0: nan} if self.options.where == "client_state" else {}
        shared = nan if self.options.where == "shared_state" else {}
        return fedmq.Aggregate(weights, {}, client_state, shared)

    def state(self) -> dict[str, torch.Tensor]:
        broken = self.options.where == "state" and getattr(self, "aggregated", False)
        return {"s": torch.tensor(float("inf"))} if broken else {"s": torch.tensor(0.0)}


class Misuses(fedmq.Strategy):
    """Gets the contract wrong the way its option says: edits `current` in place, or returns client
    state without `sends_client_state`."""

    class Options(fedmq.StrategyOptions):
        how: str = "in_place"  # in_place, client_state or shared_state

    options: Options

    def aggregate(
        self,
        ctx: fedmq.RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[fedmq.ClientResult],
        failures: Sequence[fedmq.ClientFailed],
    ) -> fedmq.Aggregate:
        if self.options.how == "in_place":
            first = next(k for k, v in current.items() if v.is_floating_point())
            current[first].add_(1.0)
            return fedmq.Aggregate(dict(current))
        own = {3: {"s": torch.zeros(1)}} if self.options.how == "client_state" else {}
        shared = {"s": torch.zeros(1)} if self.options.how == "shared_state" else {}
        return fedmq.Aggregate({k: v.clone() for k, v in current.items()}, {}, own, shared)


class LooseOptions(pydantic.BaseModel):
    bound: float = 1.0


class NotStrategyOptions(FedAvg):
    """Options on pydantic's BaseModel, not fedmq.StrategyOptions: a misspelt option would pass."""

    Options = LooseOptions  # type: ignore[assignment]


class AllowsExtra(FedAvg):
    class Options(fedmq.StrategyOptions):
        model_config = pydantic.ConfigDict(extra="allow", frozen=True)
