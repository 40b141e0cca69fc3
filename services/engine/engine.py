"""The in-process engine: a job's rounds in one loop, with the services' own semantics, by reference.

    round r:  sample_clients ─▶ TrainTask × k ─▶ Work.train_group | Work.train    (the learner's)
              ─▶ check_job_update (the aggregator's admission) ─▶ RoundState (quorum, retries)
              ─▶ rounds.fold (the strategy) ─▶ strategy_state, server evaluation, next_config
              ─▶ [federated evaluation: Work.evaluate × k ─▶ evaluated]
              ─▶ round_record, better ─▶ [checkpoint, every `checkpoint_every` rounds] ─▶ event

Nothing is encoded, queued, or written per update: tasks, updates and the global model pass by
reference between the same functions the scheduler, the learners and the aggregator call. Every
random stream is drawn where the services draw it (sampling from (seed, round), init, data and
training from (seed, round, client)), so a job ends with the services' weights, bit for bit on
CPU, and the same model digest every round (tests/integration/test_engine.py).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog
import torch

from fedmq.common.allowlist import AllowList
from fedmq.common.codec import state_digest
from fedmq.common.codec.compress import Downlink, downlink_bytes, downlinked
from fedmq.common.codec.updates import residual_entries
from fedmq.common.errors import FedmqError, ValidationError
from fedmq.common.jobspec import JobSpec, canonical_json
from fedmq.common.messages import (
    ClientUpdate,
    EvalTask,
    EventKind,
    FailedClient,
    JobEvent,
    RoundClosed,
    TrainTask,
)
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.common.strategy.clients import ClientStore
from fedmq.common.usercode import UserCodeError
from fedmq.services.aggregator.jobs import CLIENTS, RESIDUALS, AggJob, new_job, restore_job
from fedmq.services.aggregator.limits import DiskQuota, OverLimit, check_model, model_bytes, retained
from fedmq.services.aggregator.rounds import (
    client_result,
    clip_norm,
    closed_message,
    fold,
    keeps_learner_state,
    next_config,
    restored,
    save_final,
    seen_examples,
    strategy_state,
    with_server_metrics,
)
from fedmq.services.aggregator.validation import check_job_update
from fedmq.services.engine.clientstate import MemoryClientStore
from fedmq.services.engine.journal import Journal, Progress
from fedmq.services.learner.device import resolve_device
from fedmq.services.learner.work import Work, client_failure
from fedmq.services.scheduler.limits import check_submission
from fedmq.services.scheduler.records import (
    better,
    eval_clients,
    evaluated,
    federated_due,
    report_entry,
    round_record,
)
from fedmq.services.scheduler.rounds import Decision, RoundState, fails_job
from fedmq.services.scheduler.sampling import sample_clients

log = structlog.get_logger("fedmq.engine")

# An attempt's end, for RoundState: every client has answered or stays silent (an update the
# aggregator's checks refuse is dropped unannounced on the services; its client misses the deadline).
DEADLINE = math.inf
NAME = "engine"  # the learner name its updates and failures carry
DATA_CLIENTS = 1024  # clients whose data the engine keeps loaded by default (a learner: 64)


class JobStopped(Exception):
    """The job ends here: failed (its user code raised, its quorum was lost, a limit) with this reason."""

    def __init__(self, reason: str, error: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class Engine:
    """One job, trained in this process; `run()` gives the same result dict as the services' run."""

    def __init__(
        self, spec: JobSpec, settings: Settings, job_id: str, *, allowed: AllowList,
        on_event: Callable[[JobEvent], None] | None = None, on_notice: Callable[[str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.raw_spec = spec.model_dump(mode="json")
        self.job_id = job_id
        self.allowed = allowed
        sampled = spec.clients.sampled
        # One process holds the whole round: its clients train together (when they fuse), and their
        # data stays loaded from round to round, as a plain loop keeps it: every client's, up to
        # DATA_CLIENTS, unless FEDMQ_DATA_CACHE_CLIENTS says how many (at least a round's).
        cached = (settings.data_cache_clients if "data_cache_clients" in settings.model_fields_set
                  else min(spec.clients.total, DATA_CLIENTS))
        self.settings = settings.model_copy(update={
            "fuse_clients": max(settings.fuse_clients or 1, sampled),
            "data_cache_clients": max(cached, sampled),
        })
        self.root = Path(settings.state_dir) / "engine"
        self.journal = Journal(self.root, job_id, canonical_json(spec), settings.fsync)
        self.on_event = on_event or (lambda event: None)
        self.on_notice = on_notice or (lambda text: None)
        self.work = Work(self.settings, NAME, self._fetch, Metrics(), self._client_state, allowed)
        self.work.device = resolve_device(settings.device, 0)
        self.every = max(1, settings.checkpoint_every)
        self.progress = Progress()
        self.rejected: Counter[str] = Counter()
        self.stop_requested = False
        self._job: AggJob | None = None
        self._state: dict[str, torch.Tensor] = {}  # the strategy's state after the last round
        self._best_weights: dict[str, torch.Tensor] | None = None  # kept until a checkpoint writes them
        self._told_unfused = False
        self._checkpointed = -1  # the round of the last checkpoint written
        self._current = 0  # the round in progress, or the last one completed

    @property
    def job(self) -> AggJob:
        assert self._job is not None, "the engine's job is made by run()"
        return self._job

    def interrupt(self) -> None:
        """Stop after the round in progress, with a checkpoint of it (safe in a signal handler)."""
        self.stop_requested = True

    # -- the job --------------------------------------------------------------------

    def run(self, resume: bool = False) -> dict[str, Any]:
        """Train the job to its end (or to a stop); its status, history and where its model is.

        FedmqError when there is nothing to resume; a state directory that cannot be written
        (StateUnwritable, OSError) goes to the caller, the job resumable from its last checkpoint."""
        final: dict[str, Any]
        try:
            self._resume() if resume else self._start()
            self._preload()
            while self.progress.round < self.spec.rounds and not self.stop_requested:
                self._round(self.progress.round + 1)
            if self.progress.round < self.spec.rounds and self._checkpointed != self.progress.round:
                self.checkpoint()  # stopped: a checkpoint of the last round, if not yet
        except JobStopped as exc:
            final = {"status": "failed", "reason": exc.reason, **({"error": exc.error} if exc.error else {})}
            self.journal.finish(self.progress, final)
            self._event("failed", round=self._current, data=final)
            return final
        if self.progress.round < self.spec.rounds:
            return {"status": "stopped", "round": self.progress.round}
        last = self.progress.history[-1]
        final = {"status": "completed", "reason": "", "model_path": last.get("model_path"),
                 "best": self.progress.best}
        self.journal.finish(self.progress, final)
        self._event("completed", round=self.progress.round, data=final)
        return final

    def _accepted(self) -> None:
        objective = None if self.spec.objective is None else self.spec.objective.model_dump()
        data = {"name": self.spec.name, "objective": objective}
        self._event("accepted", rounds=self.spec.rounds, data=data)

    def _start(self) -> None:
        settings = self.settings
        self.journal.start()
        refusal = check_submission(self.spec, settings, 0)
        if refusal is not None:  # as the scheduler refuses it: failed, never accepted
            raise JobStopped(refusal.message)
        self._accepted()
        try:
            self._job = new_job(self.root, self.job_id, self.spec, self.allowed, settings.fsync)
            check_model(self.job.weights, settings.max_model_bytes)
        except UserCodeError as exc:
            raise JobStopped(*self._aggregator_error(exc, 0)) from None
        except FedmqError as exc:
            raise JobStopped(f"aggregator: {exc}") from None
        self._keep_state_in_memory()
        self.job.store.save_spec(canonical_json(self.spec))
        closed = self._settle(RoundClosed(job_id=self.job_id, round=0, model_digest=""))
        self._complete(round_record(closed, {}, clients=0, failed=0, seconds=0.0))

    def _resume(self) -> None:
        """The job as its last checkpoint left it; its rounds so far told again as events."""
        saved, examples = self.journal.load()
        if saved is None:
            raise FedmqError(f"job {self.job_id} in {self.root.parent} stopped before its first "
                             "checkpoint, or ended: nothing to resume (start it again)")
        self.progress = saved
        self._accepted()
        for record in saved.history:
            self._event("round_completed", round=record["round"], data=record)
        try:
            self._job = restore_job(self.root, self.job_id, self.allowed, self.settings.fsync, at=saved.round)
            self._state = strategy_state(self.job, saved.round)
        except UserCodeError as exc:
            raise JobStopped(*self._aggregator_error(exc, saved.round)) from None
        except FedmqError as exc:  # code the allow-list no longer lets in
            raise JobStopped(f"aggregator: {exc}") from None
        self.job.examples = examples  # as the checkpoint knew them (examples.json may be newer)
        self._keep_state_in_memory(load=saved.round)
        self._checkpointed = saved.round
        log.info("job_resumed", job=self.job_id, round=saved.round)

    def _keep_state_in_memory(self, load: int | None = None) -> None:
        """Per-client state (a strategy's, topk's residuals) in memory, on disk with each checkpoint."""
        root = self.job.store.root
        self.job.client_store = MemoryClientStore(ClientStore(root / CLIENTS))
        self.job.residual_store = MemoryClientStore(ClientStore(root / RESIDUALS))
        if load is not None:
            for store in (self.job.client_store, self.job.residual_store):
                store.load(load)
                store.disk.discard_from(load + 1)  # a crashed run's, after its last checkpoint

    def _preload(self) -> None:
        """Every client the rest of the job samples (training and federated evaluation), its data
        loaded before the first round, as a plain loop loads it: a round's time is then its own
        work. Only when they all fit the data cache (else each loads when its task comes)."""
        spec, todo = self.spec, []
        seen: set[int] = set()
        limit = self.settings.data_cache_clients
        for server_round in range(self.progress.round + 1, spec.rounds + 1):
            drawn = sample_clients(spec.seed, server_round, spec.clients.total, spec.clients.sampled)
            if federated_due(spec, server_round):
                drawn = drawn + eval_clients(spec, server_round)
            todo += [c for c in drawn if c not in seen]
            seen.update(drawn)
            if len(seen) == spec.clients.total or len(seen) > limit:
                break
        if not todo:
            return
        try:  # Work.preload loads nothing when they do not all fit
            loaded = self.work.preload(self._task(self.progress.round + 1, todo[0]), todo)
        except Exception:  # the job cannot load: its first task fails with the reason
            return
        log.info("client_data_loaded", clients=loaded)

    # -- a round --------------------------------------------------------------------

    def _round(self, server_round: int) -> None:
        spec = self.spec
        self._current = server_round
        started = time.monotonic()
        clients = sample_clients(spec.seed, server_round, spec.clients.total, spec.clients.sampled)
        log.info("round_started", round=server_round, clients=len(clients))
        self._event("round_started", round=server_round, data={"clients": len(clients)})
        state = RoundState(round=server_round, clients=clients, quorum=spec.clients.quorum, deadline=math.inf,
                           retries_left=spec.max_round_retries, started=started)
        updates: dict[int, ClientUpdate] = {}
        sync: dict[str, float] = {}
        todo = clients
        while True:
            self._train(server_round, todo, state, updates, sync)
            decision = state.decide(DEADLINE)
            if decision is Decision.RETRY:
                log.warning("round_retry", round=server_round, missing=len(state.missing),
                            retries_left=state.retries_left - 1)
                todo = state.retry(math.inf)
                continue
            if decision is Decision.FAIL:
                reasons = sorted(set(state.failed.values()))[:3]
                raise JobStopped(f"round {server_round}: {len(state.reported)} of {len(state.clients)} "
                                 f"clients reported, quorum is {state.quorum}; failures: "
                                 f"{reasons or 'timeouts'}")
            assert decision is Decision.CLOSE, decision
            break
        closed = self._close(server_round, state, updates)
        del updates  # the round's trained weights: only the new global model remains
        seconds = time.monotonic() - started
        record = round_record(closed, sync, len(state.reported), len(state.failed), seconds,
                              state.unreported())
        if federated_due(spec, server_round):
            self._evaluate(record)
        self._complete(record)

    def _task(self, server_round: int, client: int) -> TrainTask:
        return TrainTask(
            job_id=self.job_id, task_id=f"{self.job_id}:{server_round}:{client}", round=server_round,
            client=client, model_digest=self.job.digest, spec=self.raw_spec, config=self.progress.config,
        )

    def _tasks(self, server_round: int, clients: list[int]) -> list[TrainTask]:
        """The round's tasks: the first checked as the scheduler's are, the others copies of it that
        differ in their client (the spec, a nested dict, is validated once, not once a client)."""
        if not clients:
            return []
        first = self._task(server_round, clients[0])
        return [first] + [
            first.model_copy(update={  # their own top-level dicts, as validating gave each
                "client": c, "task_id": f"{self.job_id}:{server_round}:{c}", "spec": dict(first.spec),
                "config": dict(first.config)})
            for c in clients[1:]
        ]

    def _train(
        self, server_round: int, clients: list[int], state: RoundState, updates: dict[int, ClientUpdate],
        sync: dict[str, float],
    ) -> None:
        """Train `clients` as a learner would (together when the job fuses), then admit each update as
        the aggregator would; each outcome recorded in `state`."""
        tasks = self._tasks(server_round, clients)
        try:
            together = bool(tasks) and self.work.fusable(tasks[0])
        except Exception:  # the job cannot load: each task fails with the reason, as on a learner
            together = False
        outcomes: list[ClientUpdate | Exception]
        if together:
            groups = len(self.work.fused_groups)
            try:
                outcomes = self.work.train_group(tasks)
            except Exception as exc:  # the group's own work failed (its model, say): each task says so
                outcomes = [exc] * len(tasks)
            if len(self.work.fused_groups) == groups:
                self._say_unfused(tasks[0])
        else:
            if tasks and self.spec.train.fuse is not False:
                self._say_unfused(tasks[0])
            outcomes = [self._train_one(task) for task in tasks]
        for task, outcome in zip(tasks, outcomes, strict=True):
            if isinstance(outcome, Exception):
                self._client_failed(state, task, outcome)
                continue
            try:
                # finite: the learner's runtime saw every value finite (else the client diverged)
                check_job_update(self.job, outcome, finite=True)
            except ValidationError as exc:
                self.rejected[exc.reason] += 1  # counted, and the client stays silent, as on the services
                log.warning("update_rejected", client=task.client, reason=exc.reason, detail=str(exc)[:300])
                continue
            if state.record_update(task.client, outcome.num_examples):
                updates[task.client] = outcome
                _add(sync, "train_seconds", outcome.train_seconds)
                _add(sync, "bytes_up", float(_payload([outcome])))  # by reference here: what it holds
        if updates and "bytes_down" not in sync:  # one learner: the round's model once, by reference
            _add(sync, "bytes_down", float(downlink_bytes(self.job.weights, self.spec.compression.downlink)))

    def _say_unfused(self, task: TrainTask) -> None:
        """Once a job: its clients train one at a time, though it did not ask for that, and why."""
        if self._told_unfused:
            return
        try:
            why = self.work.unfused_reason(task)
        except Exception:  # the job cannot load: its tasks fail and say why
            return
        self._told_unfused = True
        self.on_notice(f"note: this job's clients train one at a time: {why}")

    def _train_one(self, task: TrainTask) -> ClientUpdate | Exception:
        try:
            return self.work.train(task)
        except Exception as exc:
            return exc

    def _client_failed(
        self, state: RoundState, task: TrainTask | EvalTask, exc: Exception, training: bool = True
    ) -> None:
        """A task failed: the ClientFailure a learner would send, handled as the scheduler does (the
        job fails with its user code's error under clients.on_error: fail_job, else it counts)."""
        failure = client_failure(task, exc, NAME)
        if failure.error is not None and fails_job(failure, self.spec.clients.on_error):
            raise JobStopped(failure.error.line(), failure.error.model_dump())
        state.record_client_failure(failure, training)

    def _close(self, server_round: int, state: RoundState, updates: dict[int, ClientUpdate]) -> RoundClosed:
        """The round's updates folded into the global model by the strategy, and the round settled."""
        job = self.job
        started = time.perf_counter()
        clip = clip_norm(job)
        results = [
            client_result(client, update.num_examples, update.metrics,
                          restored(job.weights, update.weights, update.delta, update.compression, clip,
                                   self.spec.compression.downlink),
                          update.extras)
            for client, update in sorted(updates.items())
        ]
        failed = [FailedClient(client=c, reason=r[:2000], phase=p[:64]) for c, r, p in state.unreported()]
        try:
            folded = fold(job, server_round, results, failed)
            residuals, state_bytes = self._keep_residuals(server_round, updates)
            examples = seen_examples(job, results)
            closed = self._settle(closed_message(job, server_round, results, folded,
                                                 _payload(updates.values()), state_bytes, started))
        except UserCodeError as exc:
            raise JobStopped(*self._aggregator_error(exc, server_round)) from None
        job.examples = examples
        job.clients.prune(server_round, folded.states)
        job.residuals.prune(server_round, residuals)
        return closed

    def _keep_residuals(
        self, server_round: int, updates: Mapping[int, ClientUpdate]
    ) -> tuple[list[int], int]:
        """fedmq's own entries each update carried (topk's residual, the Task's state), kept as its
        client's state for its next round."""
        if not keeps_learner_state(self.job):
            return [], 0
        size = 0
        for client, update in sorted(updates.items()):
            entries = residual_entries(update.extras)
            self.job.residuals.write(server_round, client, entries)
            size += sum(t.numel() * t.element_size() for t in entries.values())
        return sorted(updates), size

    def _settle(self, closed: RoundClosed) -> RoundClosed:
        """As the aggregator commits a round: its strategy state, server metrics, digest, final model
        and the next round's config (the checkpoint is written every `checkpoint_every` rounds)."""
        job, server_round = self.job, closed.round
        try:
            self._state = strategy_state(job, server_round)
            metrics = with_server_metrics(job, server_round, closed.metrics, self.settings.data_dir)
            digest = state_digest(job.weights)
            update: dict[str, Any] = {"model_digest": digest, "metrics": metrics}
            if server_round == self.spec.rounds:
                update["model_path"] = str(save_final(job, server_round, metrics))
            update["config"] = next_config(job, server_round)
        except UserCodeError as exc:
            raise JobStopped(*self._aggregator_error(exc, server_round)) from None
        job.digest, job.round = digest, server_round
        self.progress.config = update["config"]
        return closed.model_copy(update=update)

    def _aggregator_error(self, exc: UserCodeError, server_round: int) -> tuple[str, dict[str, Any]]:
        error = exc.info("aggregator", round=server_round)
        return error.line(), error.model_dump()

    def _evaluate(self, record: dict[str, Any]) -> None:
        """Sampled clients evaluate the round's model, with the scheduler's quorum and retries."""
        fed = self.spec.evaluate.federated
        assert fed is not None
        server_round = record["round"]
        clients = eval_clients(self.spec, server_round)
        state = RoundState(round=server_round, clients=clients, quorum=min(fed.quorum, len(clients)),
                           deadline=math.inf, retries_left=self.spec.max_round_retries)
        reports: dict[int, dict[str, Any]] = {}
        todo = clients
        while True:
            for client in todo:
                task = EvalTask(job_id=self.job_id, task_id=f"{self.job_id}:e{server_round}:{client}",
                                round=server_round, client=client, model_digest=self.job.digest,
                                spec=self.raw_spec)
                try:
                    report = self.work.evaluate(task)
                except Exception as exc:
                    self._client_failed(state, task, exc, training=False)
                    continue
                if state.record_update(client, report.num_examples):
                    reports[client] = report_entry(report)
            decision = state.decide(DEADLINE)
            if decision is Decision.RETRY:
                todo = state.retry(math.inf)
                continue
            break
        if decision is Decision.CLOSE:
            record["metrics"].update(evaluated(reports))
        else:
            log.warning("evaluation_below_quorum", reported=len(state.reported), quorum=state.quorum)
        record["evaluated_by"] = len(state.reported)

    def _complete(self, record: dict[str, Any]) -> None:
        """The round's record is whole: kept, the best round updated, checkpointed when due, told."""
        progress = self.progress
        progress.round = record["round"]
        progress.history.append(record)
        best = better(self.spec, record, progress.best)
        due = progress.round % self.every == 0 or progress.round == self.spec.rounds or self.stop_requested
        if best is not None:
            progress.best = best
            # Its weights until a checkpoint writes them (a checkpoint now holds them anyway).
            self._best_weights = None if due else {k: v.clone() for k, v in self.job.weights.items()}
        if due:
            self.checkpoint()
        log.info("round_closed", round=record["round"], clients=record["clients"], failed=record["failed"],
                 seconds=round(record["seconds"], 4), checkpoint=due)
        self._event("round_completed", round=record["round"], data=record)

    # -- checkpoints -----------------------------------------------------------------

    def checkpoint(self) -> None:
        """The last completed round's weights, strategy and client state, then the journal (the commit).
        A checkpoint that would take the job's folder over FEDMQ_JOB_DISK_BYTES fails the job, as
        the aggregator fails it (the folder is measured each time: client state counts from then)."""
        job, progress = self.job, self.progress
        models = 1 + (self._best_weights is not None and progress.best is not None)
        try:
            DiskQuota(job.store.root, self.settings.job_disk_bytes).need(
                models * model_bytes(job.weights), f"round {progress.round}'s checkpoint")
        except OverLimit as exc:
            raise JobStopped(f"engine: {exc}") from None
        key = job.store.write_checkpoint(progress.round, job.weights, self._state)
        job.store.commit_round(progress.round, key)
        job.checkpoint = key
        if self._best_weights is not None and progress.best is not None:
            job.store.write_checkpoint(int(progress.best["round"]), self._best_weights, {})
            self._best_weights = None
        stores = [s for s in (job.client_store, job.residual_store) if isinstance(s, MemoryClientStore)]
        for store in stores:
            store.flush()
        self.journal.save(progress, "running", job.examples)
        self._checkpointed = progress.round
        for store in stores:
            store.prune_disk()
        if self.settings.keep_checkpoints:  # as the aggregator prunes: the last N, and the best
            best = [str(progress.best["model_digest"])] if progress.best else []
            kept = retained(job.store.rounds(), progress.round, self.settings.keep_checkpoints,
                            [job.digest, *best])
            job.store.prune_checkpoints(kept)

    # -- what the learner's Work asks for --------------------------------------------------

    def _fetch(self, job_id: str, digest: str, downlink: Downlink) -> tuple[Mapping[str, torch.Tensor], int]:
        """The global model, by reference: no bytes move (rounded as compression.downlink says, as a
        learner receives it; the Work widens it back)."""
        if downlink == "none":
            return self.job.weights, 0
        return downlinked(self.job.weights, downlink), 0

    def _client_state(self, job_id: str, server_round: int, client: int) -> dict[str, torch.Tensor]:
        """A client's stored state for a round, as the aggregator serves it (strategy's and residual)."""
        return self.job.clients.read(client, before=server_round) | self.job.residuals.read(
            client, before=server_round)

    # -- telling -------------------------------------------------------------------

    def _event(self, kind: EventKind, round: int | None = None, rounds: int | None = None,
               data: dict[str, Any] | None = None) -> None:
        self.on_event(JobEvent(job_id=self.job_id, kind=kind, round=round, rounds=rounds, data=data or {}))


def _add(sync: dict[str, float], key: str, value: float) -> None:
    sync[key] = sync.get(key, 0.0) + value


def _payload(updates: Any) -> int:
    """The bytes of tensors the round's updates carry: what a deployment would move, here by reference."""
    return sum(t.numel() * t.element_size() for u in updates for part in (u.weights, u.delta, u.extras)
               for t in part.values())
