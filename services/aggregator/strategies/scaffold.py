"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II): control variates against client drift.

    client i, K local SGD steps from x:   y ← y − lr·(g_i(y) − c_i + c)
                                          c_i⁺ = c_i − c + (x − y)/(K·lr)       sends y and c_i⁺ − c_i
    server, the round's clients S of N:   x ← x + η_g·mean_S(y_i − x)
                                          c ← c + (|S|/N)·mean_S(c_i⁺ − c_i)

Means are unweighted, as in the paper. The client side is fedmq's training loop (or
`fedmq.Controls` in a Task's own `train`): the round config says
``scaffold: true`` and each learner receives c (``c.<param>``, shared by every client) and its
own c_i (``c_i.<param>``, kept per client on the aggregator's disk); it returns
``dc.<param>`` = c_i⁺ − c_i as extras. c persists in `state()`, so a restart resumes exactly.

Memory stays O(model) however many clients a round has: both means fold one client at a time
from the spooled updates (dc read tensor by tensor), and each c_i⁺ is a lazy client state the
aggregator makes and writes one client at a time (benchmarks/scaffold_memory.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from pydantic import Field

from fedmq.common.errors import AggregationError
from fedmq.common.strategy.contract import (
    SCAFFOLD,
    Aggregate,
    ClientFailed,
    ClientResult,
    Config,
    JobFacts,
    RoundContext,
    StateDict,
    Strategy,
    StrategyOptions,
)
from fedmq.common.task.scaffold import CLIENT, DELTA, SERVER
from fedmq.services.aggregator.kernels import scaffold_step, weighted_mean
from fedmq.services.aggregator.strategies.options import BuiltinOptions


class Scaffold(Strategy):
    class Options(BuiltinOptions):
        eta_g: float = Field(1.0, gt=0)  # the server learning rate η_g

    options: Options
    sends_client_state = True

    def __init__(self, options: Options | None = None) -> None:
        super().__init__(options)
        self._control: StateDict = {}  # c, by parameter name; empty (zero) before the first round

    @classmethod
    def check_job(cls, options: StrategyOptions, job: JobFacts) -> None:
        if job.optimizer != "sgd" or job.momentum != 0:
            raise ValueError(
                f"SCAFFOLD (option II) needs plain SGD steps; this job trains with {job.optimizer} "
                f"(momentum {job.momentum}): set train.optimizer: sgd and train.momentum: 0"
            )

    def configure(self, ctx: RoundContext) -> Config:
        return {SCAFFOLD: True}

    def aggregate(
        self,
        ctx: RoundContext,
        current: Mapping[str, torch.Tensor],
        results: Sequence[ClientResult],
        failures: Sequence[ClientFailed],
    ) -> Aggregate:
        averaged = weighted_mean((r.load(), 1.0) for r in results)
        averaged_delta = weighted_mean((d, 1.0) for d in same_parameters(results, current))
        weights, self._control = scaffold_step(
            current, averaged, self._control, averaged_delta,
            self.options.eta_g, len(results) / ctx.num_clients,
        )
        # Each c_i⁺ is made when the aggregator writes it, one client at a time.
        client_state = {r.client: functools.partial(next_state, ctx, r, current) for r in results}
        metrics = {
            "control_norm": _norm(self._control.values()),
            "update_norm": _norm(weights[k] - current[k] for k in averaged_delta),
        }
        shared = {SERVER + name: c for name, c in self._control.items()}
        return Aggregate(weights, metrics, client_state, shared)

    def state(self) -> StateDict:
        return {SERVER + name: c for name, c in self._control.items()}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self._control = {k[len(SERVER):]: v.clone() for k, v in state.items() if k.startswith(SERVER)}


def same_parameters(
    results: Sequence[ClientResult], current: Mapping[str, torch.Tensor]
) -> Iterator[ControlDeltas]:
    """Each client's control deltas in turn (lazy), all for the same parameters as the first's."""
    first: ControlDeltas | None = None
    for result in results:
        deltas = ControlDeltas(result, current)
        if first is not None and deltas.keys() != first.keys():
            raise AggregationError("SCAFFOLD: the clients sent control deltas for different parameters")
        if first is None:
            first = deltas
        yield deltas


class ControlDeltas(Mapping[str, torch.Tensor]):
    """A client's ``dc.<param>`` extras by parameter name, each read from its update (and checked
    against the model) when looked up: folding k clients holds one tensor of theirs at a time."""

    def __init__(self, result: ClientResult, current: Mapping[str, torch.Tensor]) -> None:
        self._extras = result.load_extras()
        self._client = result.client
        self._current = current
        self._names = [k[len(DELTA):] for k in self._extras if k.startswith(DELTA)]
        if not self._names:
            raise AggregationError(
                f"SCAFFOLD: client {result.client} sent no control deltas (extras dc.<param>); a Task "
                "with its own train must return fedmq.Controls' extras()"
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        d = self._extras[DELTA + name]
        ref = self._current.get(name)
        if ref is None or not ref.dtype.is_floating_point or d.shape != ref.shape or d.dtype != ref.dtype:
            raise AggregationError(
                f"SCAFFOLD: client {self._client}'s {DELTA}{name} matches no floating parameter of the "
                f"model ({tuple(d.shape)} {d.dtype})"
            )
        return d

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def next_state(ctx: RoundContext, result: ClientResult, current: Mapping[str, torch.Tensor]) -> StateDict:
    """The client's c_i⁺, read from what it was sent and the deltas it returned: one client's worth."""
    return next_own(ctx.client_state(result.client), ControlDeltas(result, current))


def next_own(sent: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> StateDict:
    """c_i⁺ = c_i + dc for the ``c_i.<param>`` the client was sent (zero before its first round)."""
    out: StateDict = {}
    for name, d in delta.items():
        c_i = sent.get(CLIENT + name)
        out[CLIENT + name] = d.clone() if c_i is None else c_i + d
    return out


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of the tensors taken together, in float64."""
    return math.sqrt(sum((float(t.double().pow(2).sum()) for t in tensors), 0.0))
