"""A round's new global model: aggregated, evaluated, then committed in an order that survives a crash.

    strategy.aggregate ─▶ per-client and shared state (ClientStore; topk residuals in their own) ─▶
        into the model ─▶ evaluate (the Task's server data) ─▶ checkpoint (weights +
        strategy.state(), keyed by both) ─▶ [final model, the Task's export]
        ─▶ strategy.configure(next round) ─▶ closed.json ─▶ rounds.json (the commit: a restart
        resumes from the last round it names) ─▶ older per-client state pruned

Anything that fails before the commit leaves the job's committed state as it was; the caller
puts the in-memory model back to it (jobs.rewind) before it tries again or gives up. Every
call into the strategy is user code: what it raises fails the job, naming the phase.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fedmq.common.checkpoint import save_model
from fedmq.common.codec.compress import Downlink, downlink_bytes
from fedmq.common.codec.updates import RestoredWeights, Without, check_no_prefix, rebased, residual_entries
from fedmq.common.jobspec import canonical_json
from fedmq.common.messages import CLIENT_METRICS_MAX, FailedClient, RoundClosed
from fedmq.common.strategy.checks import check_config, check_finite, check_tensor_map
from fedmq.common.strategy.clients import ClientStore
from fedmq.common.strategy.contract import (
    CLIENT_STATE,
    LEARNER_STATE,
    Aggregate,
    ClientFailed,
    ClientResult,
    ClientState,
    Config,
    RoundContext,
    Strategy,
    made,
)
from fedmq.common.task.metrics import check_metrics, reduce_metrics
from fedmq.common.task.state import keeps_state
from fedmq.common.usercode import user_code
from fedmq.services.aggregator.evaluation import evaluate_on_server
from fedmq.services.aggregator.jobs import AggJob, views
from fedmq.services.aggregator.kernels.clip import ClippedWeights
from fedmq.services.aggregator.kernels.private import delta_norm
from fedmq.services.aggregator.store import JobStore, weights_digest


def initial_round(job: AggJob, data_dir: Path | None) -> RoundClosed:
    """Round 0: the spec and the freshly built model, evaluated and committed."""
    job.store.save_spec(canonical_json(job.spec))
    return commit(job, RoundClosed(job_id=job.job_id, round=0, model_digest=""), data_dir)


def close_round(
    job: AggJob, server_round: int, clients: list[int], failed: list[FailedClient], data_dir: Path | None
) -> RoundClosed:
    """Fold the clients' stored updates into the job's model with its strategy, then commit it."""
    started = time.perf_counter()
    results = client_results(job.store, server_round, clients, job.weights, clip_norm(job),
                             job.spec.compression.downlink)
    folded = fold(job, server_round, results, failed)
    residuals, state_bytes = write_residuals(job, server_round, [r.client for r in results])
    update_bytes = sum(job.store.update_size(server_round, r.client) for r in results)
    examples = seen_examples(job, results)
    if examples != job.examples:  # written only when a client is new: most rounds write nothing
        job.store.save_json("examples", {str(c): n for c, n in sorted(examples.items())})
    closed = commit(job, closed_message(job, server_round, results, folded, update_bytes, state_bytes,
                                        started), data_dir)
    job.examples = examples
    job.clients.prune(server_round, folded.states)
    job.residuals.prune(server_round, residuals)
    return closed


@dataclass(frozen=True)
class Folded:
    """What folding a round's results into the model gave: its metrics, and whose state was written."""

    metrics: dict[str, dict[str, float]]
    states: list[int]


def clip_norm(job: AggJob) -> float | None:
    """The norm an update's delta is clipped to on arrival (clients.on_large_update: clip), if any."""
    return job.spec.clients.max_update_norm if job.spec.clients.on_large_update == "clip" else None


def fold(
    job: AggJob, server_round: int, results: list[ClientResult], failed: list[FailedClient]
) -> Folded:
    """The strategy's aggregate of `results` into the job's model, its per-client and shared state
    written to the job's stores: what both engines do with a round's results, however they came."""
    failures = [ClientFailed(f.client, f.reason, f.phase) for f in sorted(failed, key=lambda f: f.client)]
    ctx = round_context(job, server_round, tuple(r.client for r in results))
    job.clients.discard_from(server_round)  # an earlier attempt's, never committed
    job.residuals.discard_from(server_round)
    versions = tensor_versions(job.weights)
    with user_code("strategy.aggregate", round=server_round):
        out = job.strategy.aggregate(ctx, job.weights, results, failures)
        if not isinstance(out, Aggregate):
            raise TypeError(f"aggregate() returned a {type(out).__name__}, expected fedmq.Aggregate")
        check_untouched(job.weights, versions)
        strategy_metrics = check_metrics(out.metrics, "strategy metrics")
        if isinstance(out.weights, dict):  # other maps compute their tensors as they are read: once
            check_finite(out.weights, "weights")
        shared = check_tensor_map(out.shared_state, "shared_state")
        check_no_prefix(shared, "shared_state")
        check_finite(shared, "shared_state")
        check_sent(job.strategy, out.client_state, shared)
    # Before the new weights go into the model: a lazy client state may still read `current`.
    states = write_client_states(job.clients, server_round, out.client_state, shared)
    if shared:
        job.clients.write_shared(server_round, shared)
    with user_code("strategy.aggregate", round=server_round):
        load_weights(job.model, server_weights(job, out.weights))
    del out
    job.weights = views(job.model)
    metrics = {"train": train_metrics(results, job.runtime.reductions)}
    if strategy_metrics:
        metrics["strategy"] = strategy_metrics
    return Folded(metrics, states)


def server_weights(job: AggJob, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The aggregate as the model takes it: under `personalize: fedper`, the clients' own layers keep
    the server's values (clients send those back; their trained ones stay with them)."""
    personal = job.spec.personalize
    if personal is None or personal.method != "fedper":
        return weights
    from fedmq.common.task.contract import Personal
    from fedmq.common.task.layers import own_layers

    settings = Personal.from_spec(personal)
    assert settings is not None
    kept = set(own_layers(job.model, settings))
    current = job.weights
    if isinstance(weights, dict):
        return {name: current[name] if name in kept else value for name, value in weights.items()}
    return _Kept(weights, current, kept)


class _Kept(Mapping[str, torch.Tensor]):
    """A lazily computed aggregate with some of its tensors the current model's."""

    def __init__(self, weights: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor],
                 kept: set[str]) -> None:
        self.weights, self.current, self.kept = weights, current, kept

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.current[name] if name in self.kept else self.weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def seen_examples(job: AggJob, results: list[ClientResult]) -> dict[int, int]:
    """Each client's example count as first accepted (a first count stays): the bound on its next."""
    return {r.client: r.num_examples for r in results} | job.examples


def closed_message(
    job: AggJob, server_round: int, results: list[ClientResult], folded: Folded, update_bytes: int,
    state_bytes: int, started: float,
) -> RoundClosed:
    """The round's RoundClosed before its commit: clients, examples and the metrics of its fold."""
    metrics = dict(folded.metrics)
    # model_bytes: the global model as one learner receives it (half, for float32, with downlink bfloat16)
    model_bytes = downlink_bytes(job.weights, job.spec.compression.downlink)
    metrics["transport"] = {"update_bytes": float(update_bytes), "state_bytes": float(state_bytes),
                            "model_bytes": float(model_bytes)}
    return RoundClosed(
        job_id=job.job_id,
        round=server_round,
        model_digest="",
        clients=[r.client for r in results],
        num_examples=sum(r.num_examples for r in results),
        metrics=metrics,
        aggregate_seconds=time.perf_counter() - started,
        client_metrics=({r.client: dict(r.metrics) for r in results}
                        if len(results) <= CLIENT_METRICS_MAX else {}),
    )


def load_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """The aggregate's weights into the model, copied into its parameters (dtypes kept).

    A dict is loaded as load_state_dict loads it (checked finite beforehand). Any other map may
    compute each tensor as it is read (kernels.WeightedMean): it is read once, one tensor at a
    time, each checked finite and shape before it is copied, so the new model is never held whole.
    A check that fails leaves the model half written: the caller rewinds it (jobs.rewind).
    """
    own = model.state_dict()
    if not isinstance(weights, dict) and _shares_storage(own):
        # Tied tensors (one storage under two names): a tensor computed after another was written
        # would read the new values through the current model. Compute them all first.
        weights = {name: weights[name] for name in own}
    if isinstance(weights, dict):
        model.load_state_dict(weights)
        return
    if set(weights) != set(own):
        missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
        raise KeyError(f"aggregate() weights do not match the model: missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, target in own.items():
            value = weights[name]
            if value.shape != target.shape:
                raise ValueError(f"aggregate() weights: {name!r} has shape {list(value.shape)}, "
                                 f"the model's is {list(target.shape)}")
            check_finite({name: value}, "weights")
            target.copy_(value)
            del value


def _shares_storage(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether two of a model's tensors are views of one storage (tied weights)."""
    seen = [t.untyped_storage().data_ptr() for t in state.values() if t.numel()]
    return len(seen) != len(set(seen))


def tensor_versions(weights: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each tensor's version counter: torch bumps it on every in-place edit (views share it)."""
    return {name: t._version for name, t in weights.items()}


def check_untouched(weights: Mapping[str, torch.Tensor], versions: Mapping[str, int]) -> None:
    """ValueError when the strategy edited `current` (the live global model) in place."""
    edited = sorted(name for name, t in weights.items() if t._version != versions.get(name))
    if edited:
        raise ValueError(
            f"aggregate() edited `current` in place ({', '.join(edited[:3])}): it is the live global "
            "model, read-only; build new tensors (current[k] + step, current[k].clone())"
        )


def check_sent(
    strategy: Strategy, client_state: Mapping[int, ClientState], shared: Mapping[str, object]
) -> None:
    """ValueError when a strategy returns state for learners without saying it sends any."""
    if strategy.sends_client_state or not (len(client_state) or shared):
        return
    what = "client_state" if len(client_state) else "shared_state"
    raise ValueError(
        f"aggregate() returned {what}, but {type(strategy).__name__}.sends_client_state is False, so "
        "learners would never receive it: set `sends_client_state = True` on the class"
    )


def write_client_states(
    store: ClientStore, server_round: int, client_state: Mapping[int, ClientState],
    shared: Mapping[str, torch.Tensor],
) -> list[int]:
    """Each client's new state made (a lazy one called), checked and written in client order, one
    client at a time: never all of them in memory. Returns the clients written."""
    with user_code("strategy.aggregate", round=server_round):
        if not isinstance(client_state, Mapping):
            kind = type(client_state).__name__
            raise TypeError(f"client_state must be a dict of client -> state, got a {kind}")
        clients = sorted({_client_id(c): c for c in client_state}.items())
    for client, key in clients:
        with user_code("strategy.aggregate", round=server_round, client=client):
            state = check_client_state(client, made(client_state[key]), shared)
        store.write(server_round, client, state)
        del state
    return [client for client, _ in clients]


def check_client_state(
    client: int, raw: object, shared: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One client's state checked: a tensor map in names of its own, none of them shared_state's."""
    state = check_tensor_map(raw, f"client_state[{client}]")
    check_no_prefix(state, f"client_state[{client}]")
    check_finite(state, f"client_state[{client}]")
    clash = sorted(set(state) & set(shared))
    if clash:
        raise ValueError(f"client_state[{client}] and shared_state both name {clash[:3]}: rename one")
    return state


def _client_id(key: object) -> int:
    try:
        if isinstance(key, bool):
            raise TypeError
        return operator.index(key)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"client_state is keyed by client id (an int), got {key!r}") from None


def keeps_learner_state(job: AggJob) -> bool:
    """Whether updates carry state their client gets back next time: topk's residual (compression),
    the Task's own state (common/task/state.py)."""
    return job.spec.compression.keeps_residual or keeps_state(job.spec, job.runtime.task)


def write_residuals(job: AggJob, server_round: int, clients: list[int]) -> tuple[list[int], int]:
    """Keep fedmq's own entries each client's update carried (topk's residual, the Task's state) for
    its next round, as they came; return the clients and their tensor bytes (the client state the
    updates carried)."""
    if not keeps_learner_state(job):
        return [], 0
    size = 0
    for client in clients:
        stored = job.store.read_update(server_round, client)
        extras: Mapping[str, torch.Tensor] = stored.maps.get("extras", {})
        entries = residual_entries(extras)
        job.residuals.write(server_round, client, entries)
        size += sum(t.numel() * t.element_size() for t in entries.values())
    return clients, size


def round_context(job: AggJob, server_round: int, clients: tuple[int, ...] = ()) -> RoundContext:
    """What the strategy sees of a round: the job's numbers, and each client's stored state before it."""
    store = job.clients
    return RoundContext(
        round=server_round, rounds=job.spec.rounds, seed=job.spec.seed,
        num_clients=job.spec.clients.total, clients=clients,
        reader=functools.partial(_state_before, store, server_round),
    )


def next_config(job: AggJob, server_round: int) -> Config:
    """The config of the round after `server_round` ({} after the last): the strategy's, checked."""
    if server_round >= job.spec.rounds:
        return {}
    with user_code("strategy.configure", round=server_round + 1):
        config = check_config(job.strategy.configure(round_context(job, server_round + 1)))
    if job.strategy.sends_client_state:
        config[CLIENT_STATE] = True  # the learner fetches the client's state (the strategy's, and its own)
    elif keeps_learner_state(job):
        config[CLIENT_STATE] = LEARNER_STATE  # only learners make it (topk residual, Task's state)
    return config


def commit(job: AggJob, closed: RoundClosed, data_dir: Path | None) -> RoundClosed:
    """Evaluate the job's model, store it, and make it the round's: the RoundClosed to announce."""
    state = strategy_state(job, closed.round)
    metrics = with_server_metrics(job, closed.round, closed.metrics, data_dir)
    key = job.store.write_checkpoint(closed.round, job.weights, state)
    digest = weights_digest(key)  # what learners fetch the model by
    update: dict[str, object] = {"model_digest": digest, "metrics": metrics}
    if closed.round == job.spec.rounds:
        update["model_path"] = str(save_final(job, closed.round, metrics))
    update["config"] = next_config(job, closed.round)
    closed = closed.model_copy(update=update)
    # Before the commit: a restart re-sends it (with the model, when pushed, as the service adds it).
    job.store.save_json("closed", closed.model_dump(exclude={"model"}))
    job.store.commit_round(closed.round, key)
    job.digest, job.checkpoint, job.round, job.last_closed = digest, key, closed.round, closed
    job.open_round, job.expected = None, set()
    return closed


def strategy_state(job: AggJob, server_round: int) -> dict[str, torch.Tensor]:
    """The strategy's state after the round, checked: what a checkpoint keeps beside the weights."""
    with user_code("strategy.state", round=server_round):
        state = check_tensor_map(job.strategy.state(), "state()")
    # A state gone NaN is what the round's aggregate did to it (round 0: the strategy as built).
    with user_code("strategy.aggregate" if server_round else "strategy.state", round=server_round):
        check_finite(state, "state()")
    return state


def with_server_metrics(
    job: AggJob, server_round: int, metrics: Mapping[str, Mapping[str, float]], data_dir: Path | None
) -> dict[str, dict[str, float]]:
    """The round's metrics, and the model's on the Task's server data when the round evaluates there."""
    out = {source: dict(values) for source, values in metrics.items()}
    server = evaluate_on_server(job, server_round, data_dir)
    if server is not None:
        out["server"] = server
    return out


def save_final(job: AggJob, server_round: int, metrics: Mapping[str, object]) -> Path:
    """The last round's model as the job's model file, and the Task's export of it."""
    path = save_model(
        job.store.root / "model.safetensors", job.weights, canonical_json(job.spec),
        job_id=job.job_id, round=server_round, metrics=metrics,
    )
    job.runtime.export(job.model, job.store.root / "artifacts", server_round)
    return path


def train_metrics(results: list[ClientResult], rules: dict[str, str]) -> dict[str, float]:
    """The clients' training metrics combined: weighted by examples, or by the Task's rules."""
    return reduce_metrics([(r.num_examples, r.metrics) for r in results], rules)


def client_results(
    store: JobStore, server_round: int, clients: list[int], current: Mapping[str, torch.Tensor],
    clip: float | None = None, downlink: Downlink = "none",
) -> list[ClientResult]:
    """The round's stored updates for `clients`, in client order, weights read lazily from disk.

    A compressed update's weights are `current` (the round's global weights) plus its decoded
    delta, one tensor per lookup; a strategy never sees the compression, nor topk's residual.
    With `clip` (clients.max_update_norm, on_large_update: clip), an update further than that from
    `current` comes with its delta scaled down to it, as the `clipped` strategy would.
    """
    out = []
    for client in sorted(set(clients)):
        stored = store.read_update(server_round, client)
        meta = stored.fields.get("compression")
        out.append(client_result(
            client, int(stored.fields["num_examples"]), dict(stored.fields.get("metrics", {})),
            restored(current, stored, stored.maps.get("delta", {}), meta, clip, downlink),
            stored.maps.get("extras", {}),
        ))
    return out


def restored(
    current: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor],
    delta: Mapping[str, torch.Tensor], meta: Mapping[str, object] | None, clip: float | None,
    downlink: Downlink = "none",
) -> Mapping[str, torch.Tensor]:
    """An update's full weights as the strategy sees them: sent whole, or `current` plus its decoded
    delta (read one tensor per lookup), the delta scaled down to `clip` when it is longer. Whole
    weights trained from a rounded model (`downlink`) get the rounding error back (Rebased)."""
    full = rebased(weights, current, downlink) if meta is None else RestoredWeights(current, delta, meta)
    if clip is not None:
        norm = delta_norm(full, current)
        if norm > clip:
            full = ClippedWeights(full, current, clip / norm)
    return full


def client_result(
    client: int, num_examples: int, metrics: Mapping[str, object], weights: Mapping[str, torch.Tensor],
    extras: Mapping[str, torch.Tensor],
) -> ClientResult:
    """One client's result for the strategy: its weights and extras (never topk's residual), lazily."""
    return ClientResult(
        client=client,
        num_examples=num_examples,
        metrics={str(k): float(v) for k, v in metrics.items()},  # type: ignore[arg-type]
        loader=functools.partial(_itself, weights),
        extras_loader=functools.partial(_itself, Without(extras)),
    )


def _itself(value: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    return value


def _state_before(store: ClientStore, server_round: int, client: int) -> dict[str, torch.Tensor]:
    return store.read(client, before=server_round)
