"""A learner's work on one task: the job's Task, its clients' data and models, no bus.

    TrainTask ─▶ global weights (cache by digest, else fetched) ─▶ client data (bounded cache)
              ─▶ Task.train or fedmq's loop over Task.loss ─▶ ClientUpdate (the weights, or with
              the job's `compression` their encoded delta, and topk's new residual in the extras,
              quantized to the job's `residual` dtype)
    EvalTask  ─▶ the same weights and data ─▶ Task.evaluate on the client's val data ─▶ EvalReport

A learner loads data only for the clients it serves, when it first serves them, and keeps at
most `FEDMQ_DATA_CACHE_CLIENTS` clients' data at once (least recently used goes first).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

from fedmq.common import codec
from fedmq.common.allowlist import AllowList, CodeNotAllowed
from fedmq.common.codec import TensorFile, state_digest
from fedmq.common.codec.compress import CompressionSpec, Downlink, Residual, encoded_nbytes, widened, widens
from fedmq.common.codec.updates import (
    check_no_prefix,
    compress_update,
    split_residual,
    with_prefix,
)
from fedmq.common.coderefs import check_code
from fedmq.common.errors import ClientDataError, DecodeError, FedmqError
from fedmq.common.jobspec import JobSpec, canonical_json, parse_job
from fedmq.common.messages import ClientFailure, ClientUpdate, EvalReport, EvalTask, TrainTask
from fedmq.common.metrics import Metrics
from fedmq.common.seeding import secret_seed, torch_generator
from fedmq.common.settings import Settings
from fedmq.common.strategy.contract import CLIENT_STATE, LEARNER_STATE
from fedmq.common.task.contract import (
    ClientData,
    EvalContext,
    TrainContext,
    TrainResult,
    TrainSettings,
    has_train,
)
from fedmq.common.task.fused import can_fuse, group_size
from fedmq.common.task.personal import personal_model
from fedmq.common.task.runtime import TaskRuntime
from fedmq.common.task.sealing import StateSealer, still_sealed
from fedmq.common.task.state import check_state_entries, keeps_state, state_entries, state_limit, state_of
from fedmq.common.usercode import UserCodeError, user_code
from fedmq.services.learner.statecache import StateCache

log = structlog.get_logger("fedmq.learner")

MODEL_CACHE = 2  # the current round's weights, and the previous one for stragglers
LOAD_BYTES = 64 * 1024 * 1024  # a model kept in a file loads this much at a time (each load walks the model)
JOB_CACHE = 4  # jobs whose Task and model a learner keeps between tasks

# (job id, digest, downlink) -> (weights, bytes): a dict, or a large model's file read a tensor at a
# time; rounded on the wire as the job's compression.downlink says (widened back by the Work)
Fetch = Callable[[str, str, Downlink], tuple[Mapping[str, torch.Tensor], int]]
FetchState = Callable[[str, int, int], dict[str, torch.Tensor]]  # (job id, round, client) -> its state
RANDOM_KEY = (
    "train.dp_sgd's noise comes from a random key of this process: set FEDMQ_DP_KEY, the same on every "
    "learner, for runs that repeat bit for bit and for a redelivered task to draw the same noise"
)


def _folder_name(learner: str) -> str:
    """A learner's own folder: its name made safe, and a hash of it (`a/b` and `a-b` differ)."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", learner)[:64]
    return f"{safe}-{hashlib.sha256(learner.encode()).hexdigest()[:12]}"


def _own_copy_kept(task: TrainTask) -> bool:
    """Whether learners alone make the task's client state and the scheduler tracks whose copy is
    the folded one (TrainTask.state_from): a learner keeps its own and may use it."""
    return task.config.get(CLIENT_STATE) == LEARNER_STATE and task.state_from is not None


CPU_FUSE_CLIENTS = 64  # a learner's fused group on a CPU when FEDMQ_FUSE_CLIENTS is unset


def _no_state(job_id: str, server_round: int, client: int) -> dict[str, torch.Tensor]:
    raise FedmqError("this learner cannot fetch client state")


@dataclass
class JobContext:
    """What a learner keeps per job between tasks: the Task and a model on the device to reuse."""

    spec: JobSpec
    runtime: TaskRuntime
    model: nn.Module
    lent: bool = False  # the model's tensors went out in an update: it gets fresh ones before its next load
    # On an accelerator: the global model last loaded (by digest), a copy in the device's memory
    # (Work keeps one for the job it worked on last only).
    on_device: tuple[str, dict[str, torch.Tensor]] | None = None
    checked: str | None = None  # the digest of the global model last found to match this model
    plain: bool | None = None  # `_plain`, once known
    update_bytes: int | None = None  # the model's tensors as an update encodes them, once known
    said_not_fused: bool = False  # `tasks_not_fused` is logged once a job
    cannot_fuse: str | None = None  # can_fuse for its model on this device, once asked ("": it can)

    def load(
        self, weights: Mapping[str, torch.Tensor], server_round: int, client: int, digest: str | None = None
    ) -> None:
        """The global weights into the model (load_global), into fresh tensors if its own were lent.

        A model on an accelerator keeps a copy of the global model `digest` there, from which the
        round's next clients load it (a copy within the device) instead of from the host: a large
        model's file read again for each client took 0.16 s of a 202 MB model's load on an H200,
        against 0.03 s from host memory. It costs the device one model's memory, not the host; a
        device too full for it loads from the host, as before."""
        check = digest is None or digest != self.checked
        if self.lent and not check and self._plain():
            # Fresh tensors (the update keeps the old ones, unchanged) that hold the global weights,
            # names, shapes and dtypes known to match: a copy each, not load_state_dict's walk.
            with torch.no_grad():
                for name, tensor in self.model.state_dict(keep_vars=True).items():
                    given = weights[name]
                    if given.stride() == tensor.stride() and given.device == tensor.device:
                        fresh = given.clone()  # laid out as the model's: one copy, not empty + copy_
                    else:
                        fresh = torch.empty_like(tensor)  # the model's own layout (channels_last stays)
                        fresh.copy_(given)
                    tensor.data = fresh
            self.lent = False
            return
        if self.lent:
            for tensor in self.model.state_dict(keep_vars=True).values():
                tensor.data = torch.empty_like(tensor)  # the update keeps the old ones, unchanged
            self.lent = False
        if self.on_device is not None and self.on_device[0] == digest:
            self.model.load_state_dict(self.on_device[1])
            return
        self.on_device = None  # the last round's copy goes before this one is made
        # A round's clients load the same global model into the same model: its names, shapes and
        # dtypes are compared once per digest (training cannot change them: the runtime refuses it).
        load_global(self.model, weights, server_round, client, check=check)
        self.checked = digest
        state = self.model.state_dict()
        if digest is None or all(t.device.type == "cpu" for t in state.values()):
            return
        try:
            with torch.no_grad():
                self.on_device = (digest, {name: tensor.detach().clone() for name, tensor in state.items()})
        except torch.OutOfMemoryError:
            log.info("global_model_not_kept_on_device", detail="the device is too full for a copy")

    def _plain(self) -> bool:
        """Whether loading the model is only copying its tensors: no load hooks, no extra state."""
        if self.plain is None:
            modules = list(self.model.modules())
            self.plain = (
                all(isinstance(t, torch.Tensor) for t in self.model.state_dict(keep_vars=True).values())
                and not any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in modules)
            )
        return self.plain

    def trained_state(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The trained model's tensors (`state`: its state_dict, when the caller has it) for its
        update, which the bus may still be sending (a publish that timed out goes on) when the next
        task trains. On the host, when the Task promises nothing else keeps views of them
        (Task.lean_memory), the model's own, lent: its next `load` gives the model fresh ones (a copy
        would hold a large model twice); else copied to the host."""
        if has_train(self.runtime.task):  # fedmq's loop leaves none (a walk of the model's modules)
            self.model.zero_grad(set_to_none=True)  # a model's worth of memory no one reads again
        state = self.model.state_dict() if state is None else state
        if self.runtime.task.lean_memory and all(t.device.type == "cpu" for t in state.values()):
            self.lent = True
            return dict(state)  # a state_dict's tensors are detached already
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


class ClientDataCache:
    """At most `limit` clients' data, least recently used evicted first; counts what it loaded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._data: OrderedDict[tuple[str, int], ClientData] = OrderedDict()
        self.loads: dict[tuple[str, int], int] = {}  # (job, client) -> times loaded here
        self.most_held = 0

    def get(self, job_id: str, client: int, load: Callable[[], ClientData]) -> ClientData:
        key = (job_id, client)
        data = self._data.get(key)
        if data is not None:
            self._data.move_to_end(key)
            return data
        while len(self._data) >= self.limit:  # make room first: never more than `limit` held
            self._data.popitem(last=False)
        data = load()
        self.loads[key] = self.loads.get(key, 0) + 1
        self._data[key] = data
        self.most_held = max(self.most_held, len(self._data))
        return data

    def __len__(self) -> int:
        return len(self._data)


def load_global(
    model: nn.Module, weights: Mapping[str, torch.Tensor], server_round: int, client: int, check: bool = True
) -> None:
    """The global weights into this learner's model; a model that differs is the Task's build_model's fault.

    The aggregator built the global model with the same Task: tensors that do not match mean
    `build_model` gave another architecture here (it read local files, the device, a global).
    """
    mine = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()} if check else {}
    theirs = {k: _meta(weights, k) for k in weights} if check else {}
    if mine != theirs:
        diffs = [
            f"{name}: {_shape(mine.get(name))} here, {_shape(theirs.get(name))} in the global model"
            for name in sorted(mine.keys() | theirs.keys())
            if mine.get(name) != theirs.get(name)
        ]
        raise UserCodeError(
            "build_model", "ValueError",
            "the model built on this learner does not match the global model the aggregator built "
            f"({'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''}): build_model must give the "
            "same architecture in every process",
            round=server_round, client=client,
        )
    if not isinstance(weights, TensorFile | Widened):
        model.load_state_dict(weights)
        return
    # A large model's file: LOAD_BYTES of its tensors at a time, never all of it (the names, shapes
    # and dtypes were checked above, so each partial load is as strict as one whole load).
    batch: dict[str, torch.Tensor] = {}
    held = 0
    for name in weights:
        dtype, shape = weights.meta(name)
        batch[name] = weights[name]
        held += shape.numel() * dtype.itemsize
        if held >= LOAD_BYTES:
            model.load_state_dict(batch, strict=False)
            batch, held = {}, 0
    if batch:
        model.load_state_dict(batch, strict=False)


def _meta(weights: Mapping[str, torch.Tensor], name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """A tensor's shape and dtype; from a file's index, without reading it, when the model is a file."""
    if isinstance(weights, TensorFile | Widened):
        dtype, shape = weights.meta(name)
        return tuple(shape), dtype
    return tuple(weights[name].shape), weights[name].dtype


def _drop(weights: Mapping[str, torch.Tensor]) -> None:
    """Forget a cached model: a file's is deleted (nothing reads it any more)."""
    if isinstance(weights, TensorFile | Widened):
        Path(weights.path).unlink(missing_ok=True)


class Widened(Mapping[str, torch.Tensor]):
    """A rounded model's file (compression.downlink) read a tensor at a time, each bfloat16 tensor
    widened back to float32 where the learner's model has float32 (codec.compress.widened, lazily):
    a large model stays in its file, as an exact one does."""

    def __init__(self, file: TensorFile, like: Mapping[str, torch.Tensor]) -> None:
        self.file = file
        self._wide = {name for name in file if name in like and widens(file.meta(name)[0], like[name].dtype)}

    @property
    def path(self) -> str:
        return self.file.path

    def meta(self, name: str) -> tuple[torch.dtype, torch.Size]:
        dtype, shape = self.file.meta(name)
        return (torch.float32 if name in self._wide else dtype), shape

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.file[name]
        return tensor.float() if name in self._wide else tensor

    def __contains__(self, name: object) -> bool:
        return name in self.file

    def __iter__(self) -> Iterator[str]:
        return iter(self.file)

    def __len__(self) -> int:
        return len(self.file)


def compressed(
    update: ClientUpdate, global_weights: Mapping[str, torch.Tensor], spec: CompressionSpec,
    residual: Residual | None,
) -> ClientUpdate:
    """The update as the job sends it: unchanged without compression, else its encoded delta.

    `residual` is the client's topk residual as the aggregator kept it (None or empty: none yet).
    """
    if spec.codec == "none":
        return update
    try:
        check_no_prefix(update.extras, "TrainResult.extras")
    except ValueError as exc:
        raise FedmqError(str(exc)) from None
    encoded, new_residual = compress_update(update.weights, global_weights, spec, residual)
    extras = update.extras | (with_prefix(new_residual) if new_residual is not None else {})
    return update.model_copy(update={"weights": {}, "delta": encoded.tensors, "compression": encoded.meta,
                                     "extras": extras})


def client_failure(task: TrainTask | EvalTask, exc: Exception, learner: str) -> ClientFailure:
    """The ClientFailure a task's error makes, logged: the user's code raised (with its UserError),
    fedmq refused the task, or something crashed. A learner sends it; the engine records it as the
    scheduler would."""
    if isinstance(exc, UserCodeError):
        log.warning("user_code_failed", phase=exc.phase, error_type=exc.error_type, error=exc.message[:300])
        error = exc.info("learner", round=task.round, client=task.client, learner=learner)
        code, reason = "user_code", error.line()
    elif isinstance(exc, FedmqError):  # no data fails the same on every attempt: not retried
        log.warning("task_failed", error=str(exc))
        code = "no_data" if isinstance(exc, ClientDataError) else "invalid"
        reason, error = str(exc), None
    else:
        log.error("task_crashed", error=f"{type(exc).__name__}: {exc}"[:500], exc_info=exc)
        code, reason, error = "error", f"{type(exc).__name__}: {exc}", None
    return ClientFailure(job_id=task.job_id, task_id=task.task_id, round=task.round, client=task.client,
                         code=code, reason=reason[:500], learner=learner, error=error)


def fuse_budget(device: torch.device) -> int:
    """A quarter of the device's free memory (the host's available memory on CPU; 1 GiB unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]) // 4
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024 // 4
    except (OSError, StopIteration, ValueError, IndexError):
        return 1 << 30


def _shape(spec: tuple[tuple[int, ...], torch.dtype] | None) -> str:
    return "missing" if spec is None else f"{list(spec[0])} {str(spec[1]).removeprefix('torch.')}"


class Work:
    """Trains and evaluates tasks on this learner's device."""

    def __init__(
        self, settings: Settings, name: str, fetch: Fetch, metrics: Metrics,
        fetch_state: FetchState = _no_state, allowed: AllowList | None = None,
        sealer: StateSealer | None = None,
    ) -> None:
        self.settings = settings
        self.allowed = allowed or AllowList.services(settings.allowed_prefixes)
        self.name = name
        self.device = torch.device("cpu")
        self.fetch = fetch
        self.fetch_state = fetch_state
        # Client state leaves for the aggregator sealed with the learners' FEDMQ_STATE_KEY (sealing.py);
        # None: unsealed (the engine, whose state never leaves it; a learner without the key)
        self.sealer = sealer
        self.metrics = metrics
        # The state of clients this learner trained, for when the scheduler sends them back to it.
        self.kept = StateCache(
            Path(settings.state_dir) / "learner" / "state-cache" / _folder_name(name),
            settings.state_cache_bytes,
            settings.state_cache_disk_bytes, sealer, lambda event: metrics.state_cache.labels(event).inc(),
        )
        # DP-SGD's secret (the same on every learner, never on the server); else one of this process's.
        self.dp_key = (settings.dp_key.get_secret_value().encode() if settings.dp_key is not None
                       else secrets.token_bytes(32))
        self.data = ClientDataCache(settings.data_cache_clients)
        self._jobs: OrderedDict[str, JobContext] = OrderedDict()
        self._models: OrderedDict[str, Mapping[str, torch.Tensor]] = OrderedDict()
        self.fetches = 0  # global models fetched over the bus (the rest came from the cache)
        self.fused_groups: list[int] = []  # the size of each group trained fused, oldest first

    def train(self, task: TrainTask) -> ClientUpdate:
        """The task's update, its weights a copy of the trained model's: the bus may still be sending
        them (a publish that timed out goes on) when this learner trains its next task."""
        job = self._job(task.job_id, task.spec)
        started = time.perf_counter()
        weights, fetch_bytes = self._weights(job, task.job_id, task.model_digest, task.model)
        stored = self._kept_state(task) if task.config.get(CLIENT_STATE) else {}
        client_state, residual = split_residual(stored)  # the strategy's, and compression's own
        fetched = time.perf_counter()
        data = self._client_data(job, task.job_id, task.client)
        job.load(weights, task.round, task.client, task.model_digest)
        ctx = self._context(job, task, weights, client_state)
        ctx.state.update(state_of(stored, self.device))  # the Task's own, from its last round
        trained, result = job.runtime.trained(job.model, data, ctx)
        state = job.trained_state(trained)
        seconds = time.perf_counter() - fetched
        self.metrics.train_seconds.observe(seconds)
        try:  # the client's state for its next round rides with the update (common/task/state.py)
            check_no_prefix(result.extras, "TrainResult.extras")
            entries = state_entries(ctx.state) if keeps_state(job.spec, job.runtime.task) else {}
            sent = entries
            if entries:  # the aggregator's own check, named here
                check_state_entries(entries, state_limit(state))
                if self.sealer is not None:
                    sent = self.sealer.seal(entries, task.job_id, task.client)
                    check_state_entries(sent, state_limit(state))
        except (TypeError, ValueError) as exc:
            raise UserCodeError("train" if has_train(job.runtime.task) else "loss", type(exc).__name__,
                                str(exc), round=task.round, client=task.client) from None
        update = self._update(job, task, weights, state, result, seconds, fetched - started, fetch_bytes,
                              residual)
        if _own_copy_kept(task):
            # Kept here too (the scheduler tracks who holds what), in the clear, under a tag of this
            # training: the scheduler names it back only if the aggregator folded this very update.
            tag = secrets.token_hex(16)
            self.kept.put(task.job_id, task.client, tag, {**update.extras, **entries})
            update = update.model_copy(update={"state_tag": tag})
        return update.model_copy(update={"extras": {**update.extras, **sent}}) if sent else update

    def fusable(self, task: TrainTask) -> bool:
        """Whether this task goes to `train_group`: its job does not refuse fusing (train.fuse: false)
        and keeps no client state.
        (Its spec is checked when the job loads; a task of a job that cannot load trains alone,
        to fail with the reason, counted once.)"""
        train = task.spec.get("train")
        if (isinstance(train, dict) and train.get("fuse") is False) or task.config.get(CLIENT_STATE):
            return False
        job = self._job(task.job_id, task.spec)
        if (job.spec.train.fuse is False or has_train(job.runtime.task)
                or keeps_state(job.spec, job.runtime.task)):
            return False
        if job.cannot_fuse is None:  # its model, this device and its train section decide: once a job
            job.cannot_fuse = can_fuse(job.model, self._context(job, task, {}, {})) or ""
        return not job.cannot_fuse

    def unfused_reason(self, task: TrainTask) -> str:
        """Why a task's clients train one at a time though its job may fuse (said once by `fedmq run`)."""
        job = self._job(task.job_id, task.spec)
        if has_train(job.runtime.task):
            return "its Task trains with its own train()"
        if keeps_state(job.spec, job.runtime.task):
            return ("its clients keep state between rounds (personalize, train.keep_optimizer_state, "
                    "Task.keeps_state)")
        if task.config.get(CLIENT_STATE):
            return "its strategy or compression keeps state per client (SCAFFOLD, topk's residuals)"
        ctx = self._context(job, task, job.model.state_dict(), {})
        return can_fuse(job.model, ctx) or (
            "its data or loss cannot be batched across clients (a DataLoader, random draws in the loss, "
            "metrics that are not tensors)")

    def preload(self, task: TrainTask, clients: list[int]) -> int:
        """The data of `clients` (of the task's job) into the data cache now, when all of them fit
        it; how many were loaded (0: they do not fit, and load as their tasks come). A client whose
        data fails to load is left to its task, which fails with the reason."""
        if len(clients) > self.data.limit:
            return 0
        job = self._job(task.job_id, task.spec)
        loaded = 0
        for client in clients:
            try:
                self._client_data(job, task.job_id, client)
            except Exception:  # its task loads it again and fails with the reason, as before
                continue
            loaded += 1
        return loaded

    def job_spec(self, task: TrainTask) -> JobSpec:
        """The task's job spec, as parsed when its job loaded (`fusable` loaded it)."""
        return self._job(task.job_id, task.spec).spec

    def train_group(self, tasks: list[TrainTask]) -> list[ClientUpdate | Exception]:
        """Tasks of one fused job, round and global model, trained together in groups of at most
        `group_limit`; each task's update, or the error that fails it (its data, a divergence).

        A model or Task fusion cannot take trains them one at a time; a task alone trains through
        the same kernel as a group, so its client's bits do not depend on the others (on CPU)."""
        first = tasks[0]
        job = self._job(first.job_id, first.spec)
        # A fused group holds its clients' data at once anyway; a cache smaller than a group would
        # load every client of every round again (100 digits clients a round: 64 cached, none hit).
        self.data.limit = max(self.data.limit, min(len(tasks), self.fuse_clients))
        started = time.perf_counter()
        weights, fetch_bytes = self._weights(job, first.job_id, first.model_digest, first.model)
        fetched = time.perf_counter()
        job.load(weights, first.round, first.client, first.model_digest)
        out: list[ClientUpdate | Exception | None] = [None] * len(tasks)
        ready: list[tuple[int, ClientData, TrainContext]] = []
        for i, task in enumerate(tasks):
            try:
                data = self._client_data(job, task.job_id, task.client)
            except Exception as exc:  # this client's data: its failure alone
                out[i] = exc
                continue
            ready.append((i, data, self._context(job, task, weights, {})))
        limit = self.group_limit(job)
        # The model's fetch is the first update's (its time and bytes), as one at a time the rest
        # would find it cached: a round's figures count each fetch once.
        fetch = [(fetched - started, fetch_bytes)] + [(0.0, 0)] * len(tasks)
        holds_global = True  # False once a client trained alone: the model holds its weights
        for at in range(0, len(ready), limit):
            chunk = ready[at:at + limit]
            began = time.perf_counter()
            if not holds_global:
                job.load(weights, first.round, first.client, first.model_digest)
                holds_global = True
            trained = job.runtime.train_group(job.model, [d for _, d, _ in chunk], [c for _, _, c in chunk])
            if trained is None:  # one at a time, as `train` does
                if not job.said_not_fused and self.fuse_clients > 1:  # once a job, when asked to fuse
                    log.info("tasks_not_fused", count=len(chunk), group=len(ready))
                    job.said_not_fused = True
                for i, data, ctx in chunk:
                    try:
                        began = time.perf_counter()
                        if not holds_global:  # a fusing that declined left the global weights as they were
                            job.load(weights, tasks[i].round, tasks[i].client, first.model_digest)
                        holds_global = False
                        state, result = job.runtime.trained(job.model, data, ctx)
                        out[i] = self._update(job, tasks[i], weights, job.trained_state(state), result,
                                              time.perf_counter() - began, *fetch[0])
                        fetch.pop(0)
                    except Exception as exc:
                        out[i] = exc
                continue
            seconds = (time.perf_counter() - began) / len(chunk)  # each client's share of the group's time
            self.fused_groups.append(len(chunk))
            log.info("tasks_fused", count=len(chunk), seconds=round(seconds * len(chunk), 4), limit=limit)
            for (i, _, _), one in zip(chunk, trained, strict=True):
                if isinstance(one, Exception):
                    out[i] = one
                    continue
                self.metrics.train_seconds.observe(seconds)
                try:
                    out[i] = self._update(job, tasks[i], weights, one[0], one[1], seconds, *fetch[0])
                    fetch.pop(0)
                except Exception as exc:
                    out[i] = exc
        return [o if o is not None else FedmqError("not trained") for o in out]

    def gather_limit(self, task: TrainTask, message_bytes: int) -> int:
        """The most tasks of its job, round and model trained and sent as one group: its fused
        group's limit, or as many updates as `message_bytes` of the model's tensors hold."""
        job = self._job(task.job_id, task.spec)
        if job.update_bytes is None:  # training never changes the model's tensors' sizes
            job.update_bytes = encoded_nbytes(job.model.state_dict())
        return max(self.group_limit(job), message_bytes // max(1, job.update_bytes))

    def group_limit(self, job: JobContext) -> int:
        """The most clients in one fused group: FEDMQ_FUSE_CLIENTS, and what fits the memory budget."""
        if self.fuse_clients <= 1:
            return 1
        budget = self.settings.fuse_memory_bytes or fuse_budget(self.device)
        fits = group_size(job.model, self._train_settings(job), budget)
        return max(1, min(self.fuse_clients, fits))

    @property
    def fuse_clients(self) -> int:
        """FEDMQ_FUSE_CLIENTS; unset, 64 on a CPU, where a client's fused bits do not depend on its
        group, and 1 on an accelerator, where the batched kernels may change the last bits with the
        group's size (each client then trains as a group of two, the same bits in any run)."""
        if self.settings.fuse_clients is not None:
            return self.settings.fuse_clients
        return CPU_FUSE_CLIENTS if self.device.type == "cpu" else 1

    def _train_settings(self, job: JobContext) -> TrainSettings:
        """Made for each task: a Task may write into its `options`, and no client may see another's."""
        return TrainSettings.from_spec(job.spec.train, job.spec.personalize)

    def _context(
        self, job: JobContext, task: TrainTask, weights: Mapping[str, torch.Tensor],
        client_state: dict[str, torch.Tensor],
    ) -> TrainContext:
        private = None
        generator = torch_generator(job.spec.seed, "train", task.round, task.client)
        if job.spec.train.dp_sgd is not None:  # DP-SGD: noise and batch order the server cannot recompute
            private = secret_seed(self.dp_key, job.spec.seed, task.round, task.client)
            generator = torch_generator(private, "train")
        return TrainContext(
            client=task.client, round=task.round, seed=job.spec.seed, device=self.device,
            train=self._train_settings(job), generator=generator,
            global_weights=weights, config=task.config,
            client_state={k: v.to(self.device) for k, v in client_state.items()}, private_seed=private,
        )

    def _update(
        self, job: JobContext, task: TrainTask, weights: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor], result: TrainResult, seconds: float, fetch_seconds: float,
        fetch_bytes: int, residual: Residual | None = None,
    ) -> ClientUpdate:
        """The client's update, compressed as the job says (`residual`: topk's, kept as client state)."""
        if result.num_examples == 0:
            raise ClientDataError(f"client {task.client} has no training data")
        log.info("task_trained", client=task.client, examples=result.num_examples, seconds=round(seconds, 4),
                 loss=round(result.metrics.get("loss", float("nan")), 4),
                 site=job.spec.clients.site(task.client))
        update = ClientUpdate(
            job_id=task.job_id, task_id=task.task_id, round=task.round, client=task.client,
            base_digest=task.model_digest, num_examples=result.num_examples, metrics=dict(result.metrics),
            train_seconds=seconds, fetch_seconds=fetch_seconds, fetch_bytes=fetch_bytes,
            learner=self.name, weights=state, extras=dict(result.extras),
        )
        return compressed(update, weights, job.spec.compression, residual)

    def evaluate(self, task: EvalTask) -> EvalReport:
        job = self._job(task.job_id, task.spec)
        started = time.perf_counter()
        weights, fetch_bytes = self._weights(job, task.job_id, task.model_digest, task.model)
        fetch_seconds = time.perf_counter() - started
        data = self._client_data(job, task.job_id, task.client)
        job.load(weights, task.round, task.client, task.model_digest)
        report = EvalReport(job_id=task.job_id, task_id=task.task_id, round=task.round, client=task.client,
                            num_examples=0, learner=self.name, fetch_bytes=fetch_bytes,
                            fetch_seconds=fetch_seconds)
        if data.val is None:
            return report  # this client holds no validation data
        ctx = EvalContext(round=task.round, seed=job.spec.seed, device=self.device,
                          batch_size=job.spec.train.batch_size, client=task.client)
        result = job.runtime.evaluate(job.model, data.val, ctx)
        personal = self._personal_metrics(job, task, data.val, ctx)
        return report.model_copy(update={
            "num_examples": result.num_examples, "metrics": dict(result.metrics), "personal": personal,
            "reduction": {k: v for k, v in job.runtime.reductions.items() if k in result.metrics},
        })

    def _personal_metrics(
        self, job: JobContext, task: EvalTask, data: Any, ctx: EvalContext
    ) -> dict[str, float]:
        """Under `personalize`, the client's personal model (its state after the round evaluated)
        on `data`; {} otherwise, and for a client that never trained (it has none). The model holds
        it afterwards: each task loads its own weights."""
        settings = self._train_settings(job).personal
        if settings is None:
            return {}
        stored = self._stored_state(task.job_id, task.round + 1, task.client)  # with the round's training
        with user_code("evaluate", round=task.round, client=task.client):
            if not personal_model(job.model, state_of(stored), settings):
                return {}
        return dict(job.runtime.evaluate(job.model, data, ctx).metrics)

    def _kept_state(self, task: TrainTask) -> dict[str, torch.Tensor]:
        """The client's state before the task's round: none yet, this learner's own copy of the
        version the aggregator keeps, or that version fetched (learner/statecache.py)."""
        if _own_copy_kept(task):
            if task.state_from == 0:
                return {}  # no round has folded this client yet: nothing kept anywhere
            own = self.kept.get(task.job_id, task.client, task.state_tag)
            if own is not None:
                return own
            self.metrics.state_cache.labels("miss").inc()
        return self._stored_state(task.job_id, task.round, task.client)

    def _stored_state(self, job_id: str, server_round: int, client: int) -> dict[str, torch.Tensor]:
        """A client's kept state before `server_round` (the strategy's, compression's, the Task's),
        opened when the learners sealed it."""
        stored = self.fetch_state(job_id, server_round, client)
        if self.sealer is None:
            still_sealed(stored, client)
            return dict(stored)
        return self.sealer.open(stored, job_id, client)

    def _job(self, job_id: str, raw_spec: dict[str, object]) -> JobContext:
        job = self._jobs.get(job_id)  # a job's spec never changes after submission
        if job is None:
            spec = parse_job(raw_spec)
            try:
                check_code(spec, self.allowed)  # as the scheduler did: this task may have come another way
                runtime = TaskRuntime.for_job(spec, self.allowed)
            except CodeNotAllowed as exc:
                log.warning("job_code_refused", what=exc.what, module=exc.module)
                self.metrics.refused_code(exc.what)
                raise
            job = JobContext(spec, runtime, runtime.build_model().to(self.device))
            self._jobs[job_id] = job
            if spec.train.dp_sgd is not None and self.settings.dp_key is None:
                log.warning("dp_key_random", job=job_id, detail=RANDOM_KEY)
            while len(self._jobs) > JOB_CACHE:
                self._jobs.popitem(last=False)
            log.info("job_loaded", spec=canonical_json(spec)[:200])
        else:
            self._jobs.move_to_end(job_id)
        for other in self._jobs.values():  # one global model kept on an accelerator: this job's
            if other is not job:
                other.on_device = None
        return job

    def _client_data(self, job: JobContext, job_id: str, client: int) -> ClientData:
        data_dir = self.settings.data_dir
        return self.data.get(job_id, client, lambda: job.runtime.load_data(client, data_dir))

    def _pushed(self, packed: bytes, digest: str) -> tuple[dict[str, torch.Tensor] | None, int]:
        """The model a task brought, and its size, if it decodes to tensors that hash to `digest`
        (else None: it is fetched from the aggregator, which keeps the model that digest names)."""
        try:
            weights = codec.unpackb(packed, max_bytes=self.settings.max_message_bytes)
        except DecodeError:
            weights = None
        tensors = isinstance(weights, dict) and all(
            isinstance(name, str) and isinstance(t, torch.Tensor) for name, t in weights.items())
        if tensors and weights and state_digest(weights) == digest:
            return weights, len(packed)
        log.warning("pushed_model_refused", digest=digest[:12])
        return None, 0

    def _weights(
        self, job: JobContext, job_id: str, digest: str, pushed: bytes = b""
    ) -> tuple[Mapping[str, torch.Tensor], int]:
        """The round's global model, and the bytes it took: from the cache by digest (0); else the
        model that came with the task (`pushed`), if it hashes to the digest; else fetched (with
        compression.downlink, rounded on the wire and widened back to the model's dtypes here)."""
        downlink = job.spec.compression.downlink
        key = digest if downlink == "none" else f"{digest}/{downlink}"  # two jobs may share a model
        weights = self._models.get(key)
        if weights is not None:
            self._models.move_to_end(key)
            return weights, 0
        came, size = self._pushed(pushed, digest) if pushed and downlink == "none" else (None, 0)
        if came is not None:
            weights = came
        else:
            weights, size = self.fetch(job_id, digest, downlink)
            if downlink != "none":  # a large one stays in its file, widened a tensor at a time
                like = job.model.state_dict()
                if isinstance(weights, TensorFile):
                    weights = Widened(weights, like)
                else:
                    weights = widened(weights, like)
            if size:  # over the bus (0: by reference, or from the folder the host's learners share)
                self.fetches += 1
                self.metrics.model_fetches.inc()
        self._models[key] = weights
        while len(self._models) > MODEL_CACHE:
            _drop(self._models.popitem(last=False)[1])
        return weights, size
