"""The Python API: run a job in this process or on a RabbitMQ cluster with the same call.

    import fedmq

    job = fedmq.Job(name="digits", task="digits", clients={"total": 10}, rounds=20)
    result = fedmq.run(job)                                   # in this process (the engine), no broker
    result = fedmq.run(job, broker="amqp://user:pw@host/vh")  # on a cluster's services

    with fedmq.Runner() as runner:                            # several jobs, one after another
        for lr in (0.01, 0.05):
            results.append(runner.run(job.with_changes(train={"lr": lr}), callbacks=[Printer()]))

Callbacks follow the job as it goes (seed 002's hook names, a round standing for an epoch).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import structlog

from fedmq.common.allowlist import AllowList
from fedmq.common.bus import topology
from fedmq.common.errors import ConfigError
from fedmq.common.jobcheck import complete_spec
from fedmq.common.jobspec import JobSpec, parse_job
from fedmq.common.messages import JobCancel, JobEvent, JobSubmit, to_wire
from fedmq.common.settings import Settings
from fedmq.services.api.result import Result, RoundRecord
from fedmq.services.cli.follow import TERMINAL, JobFollower

if TYPE_CHECKING:
    import torch

    from fedmq.services.cli.embedded import EmbeddedCluster
    from fedmq.services.cli.remote import Remote

QUIET_S = 15.0  # on a cluster, with no event for this long, ask the scheduler how the job stands
CANCEL_WAIT_S = 10.0  # a job `run` stops following is cancelled; this long for the scheduler to confirm

log = structlog.get_logger("fedmq.api")


class Callback:
    """Override what you need; each hook runs in the thread that called `run`."""

    def on_train_start(self, job: JobSpec, job_id: str) -> None:
        """The scheduler accepted the job."""

    def on_round_start(self, round: int) -> None:
        """A training round was opened (its clients' tasks are out)."""

    def on_round_end(self, round: int, record: RoundRecord) -> None:
        """A round's record is complete: its metrics of every source (round 0: the initial model)."""

    def on_progress(self, rank: int, lines: list[str], reports: list[dict[str, Any]]) -> None:
        """A DDP job's rank printed `lines`; on rank 0, `reports` are what its entry reported
        with fedmq.ddp.report: {"step", "metrics", and "total" when given}, oldest first."""

    def on_train_end(self, result: Result) -> None:
        """The job ended: completed, failed or cancelled (`result.status`)."""


class Runner:
    """fedmq's services for this program: embedded (no broker) or a cluster's, over RabbitMQ."""

    def __init__(
        self,
        broker: str | None = None,
        *,
        learners: int = 1,
        state_dir: str | Path | None = None,
        settings: Settings | None = None,
        log_level: str = "warning",
        services: bool = False,
    ) -> None:
        """No `broker`: jobs run in this process, on the in-process engine; with `services` (or
        `learners` > 1, or broker="memory://") on the services' threads over an in-memory bus
        instead, as deployed."""
        from fedmq.common.logging import configure_logging

        configure_logging("auto", log_level)  # the services log at info: too much for a program
        overrides: dict[str, Any] = {}
        if broker is not None:
            overrides["broker_url"] = broker
        if state_dir is not None:
            overrides["state_dir"] = Path(state_dir)
        # Built with the overrides, so that they are validated too (a broker URL and its password setting).
        self.settings = Settings(**overrides) if settings is None else settings.model_copy(update=overrides)
        # broker="memory://": the services in this process on their in-memory bus (no one else's)
        in_memory = broker is not None and self.settings.in_memory
        self.remote_mode = broker is not None and not in_memory
        self.learners = learners
        self.services = services or learners > 1 or in_memory
        self._cluster: EmbeddedCluster | None = None
        self._remote: Remote | None = None
        self._engine = False
        self._lock = threading.Lock()

    def __enter__(self) -> Runner:
        if self.remote_mode:
            from fedmq.services.cli.remote import Remote

            self._remote = Remote(self.settings).__enter__()
        elif not self.services:
            self._engine = True
        else:
            from fedmq.services.cli.embedded import EmbeddedCluster

            # This program's own code runs here, as `fedmq run`'s does: its project is allowed.
            self._cluster = EmbeddedCluster(
                self.settings, learners=self.learners, allowed=self._project()
            ).__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _project(self) -> AllowList:
        """The code this program may import for a job: fedmq's, FEDMQ_ALLOWED_CODE's and its project's."""
        return AllowList.project(self.settings.allowed_prefixes)

    def close(self) -> None:
        """Stop the embedded services, or disconnect from the cluster."""
        if self._cluster is not None:
            self._cluster.__exit__(None, None, None)
            self._cluster = None
        if self._remote is not None:
            self._remote.__exit__(None, None, None)
            self._remote = None
        self._engine = False

    def run(
        self,
        job: JobSpec | Mapping[str, Any],
        *,
        callbacks: Iterable[Callback] = (),
        timeout: float | None = None,
    ) -> Result:
        """Submit `job`, follow it to its end calling `callbacks`, and return its Result.

        The spec is checked first (its Task is imported and its options validated): a bad
        one raises ConfigError here. `timeout` bounds the silence between two events. If this
        call ends other than by the job's end (a callback raises, the timeout, Ctrl-C), the job
        is cancelled before the exception goes on: no job trains on unwatched.
        """
        if self._cluster is None and self._remote is None and not self._engine:
            raise RuntimeError("use the Runner as a context manager (with fedmq.Runner() as runner: ...)")
        spec = job if isinstance(job, JobSpec) else parse_job(dict(job))  # fedmq's ConfigError, as YAML's
        spec = complete_spec(spec, self._project())
        if self.remote_mode and spec.task.name.startswith("__main__:"):
            raise ConfigError(
                f"task {spec.task.name!r} lives in the running script and the cluster's services cannot "
                "import it: move the Task class to a module they can import"
            )
        from fedmq.services.cli.embedded import new_job_id

        job_id = new_job_id(spec)
        hooks = list(callbacks)
        if self._engine:
            return self._run_here(spec, job_id, hooks)
        with self._lock:  # one job at a time per Runner: its events and callbacks stay in order
            follower = self._follower(job_id)
            try:
                submit = JobSubmit(job_id=job_id, spec=spec.model_dump(mode="json"))
                follower.bus.publish(topology.SCHEDULER, to_wire(submit))
                raw_history, final = self._follow(follower, spec, job_id, hooks, timeout)
            except BaseException as exc:  # a callback raised, a timeout, Ctrl-C: nobody follows the job now
                self._cancel(follower, job_id, f"the program running it stopped: {type(exc).__name__}")
                raise
            finally:
                if self._cluster is not None:
                    follower.close()
        result = Result(
            job_id=job_id, spec=spec, status=str(final.get("status", "unknown")),
            reason=str(final.get("reason") or ""), history=[RoundRecord.of(h) for h in raw_history],
            best=final.get("best"), model_path=final.get("model_path"), _fetch=self._fetcher(job_id),
            _client_state=self._client_states(job_id),
        )
        for hook in hooks:
            hook.on_train_end(result)
        return result

    def _run_here(self, spec: JobSpec, job_id: str, hooks: list[Callback]) -> Result:
        """The job on the in-process engine, its events told to the callbacks as they come."""
        from fedmq.services.engine.journal import cancel
        from fedmq.services.engine.run import run_job

        history: dict[int, dict[str, Any]] = {}

        def tell(event: JobEvent) -> None:
            self._on_event(event, spec, job_id, hooks, history)

        with self._lock:
            try:
                done = run_job(spec, self.settings, job_id=job_id, allowed=self._project(), on_event=tell)
            except BaseException as exc:  # a callback raised, Ctrl-C: the job stops here, recorded so
                why = f"the program running it stopped: {type(exc).__name__}"
                cancel(self.settings.state_dir, job_id, why)
                raise
        result = Result(
            job_id=job_id, spec=spec, status=str(done.get("status", "unknown")),
            reason=str(done.get("reason") or ""), history=[RoundRecord.of(h) for h in done["history"]],
            best=done.get("best"), model_path=done.get("model_path"), _fetch=self._fetcher(job_id),
            _client_state=self._client_states(job_id),
        )
        for hook in hooks:
            hook.on_train_end(result)
        return result

    def _cancel(self, follower: JobFollower, job_id: str, reason: str) -> None:
        """Cancel a job this call no longer follows, and wait a little for the scheduler to say so.

        Otherwise it would go on training unwatched: on the cluster, or here, where the next
        Runner on the same state directory would resume it.
        """
        try:
            follower.bus.publish(topology.SCHEDULER, to_wire(JobCancel(job_id=job_id, reason=reason)))
            deadline = time.monotonic() + CANCEL_WAIT_S
            for event in follower.events(idle_timeout=CANCEL_WAIT_S):
                if event.kind in TERMINAL or time.monotonic() > deadline:
                    break
        except Exception as exc:  # best effort: the caller's own exception is what matters
            log.warning("job_cancel_failed", job=job_id, error=f"{type(exc).__name__}: {exc}")

    def _follower(self, job_id: str) -> JobFollower:
        if self._cluster is not None:
            return JobFollower(self._cluster.connect("api"), job_id).start()
        assert self._remote is not None
        return self._remote.follow(job_id)

    def _follow(
        self, follower: JobFollower, spec: JobSpec, job_id: str, hooks: list[Callback], timeout: float | None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        history: dict[int, dict[str, Any]] = {}
        final: dict[str, Any] = {}
        while not final:
            try:
                for event in follower.events(idle_timeout=QUIET_S if self._remote is not None else timeout):
                    final = self._on_event(event, spec, job_id, hooks, history)
            except TimeoutError:
                if self._remote is None:
                    raise
                final = self._catch_up(job_id, history, hooks)  # events are best effort across reconnects
        return [history[r] for r in sorted(history)], final

    @staticmethod
    def _on_event(
        event: JobEvent, spec: JobSpec, job_id: str, hooks: list[Callback], history: dict[int, dict[str, Any]]
    ) -> dict[str, Any]:
        for hook in hooks:
            if event.kind == "accepted":
                hook.on_train_start(spec, job_id)
            elif event.kind == "round_started" and event.round is not None:
                hook.on_round_start(event.round)
            elif event.kind == "progress":
                data = event.data
                hook.on_progress(int(data.get("rank", 0)), list(data.get("lines", [])),
                                 list(data.get("reports", [])))
        if event.kind == "round_completed" and event.round is not None:
            history[event.round] = dict(event.data)
            for hook in hooks:
                hook.on_round_end(event.round, RoundRecord.of(event.data))
        if event.kind in TERMINAL:
            return {"status": event.kind, **event.data}
        return {}

    def _catch_up(
        self, job_id: str, history: dict[int, dict[str, Any]], hooks: list[Callback]
    ) -> dict[str, Any]:
        """The job as the scheduler has it; rounds whose events were lost reach the callbacks now."""
        assert self._remote is not None
        reply = self._remote.status("job", job_id)
        if reply.error or not reply.jobs:
            return {}
        job = reply.jobs[0]
        for record in sorted(job.get("history", []), key=lambda h: int(h["round"])):
            if record["round"] not in history:
                history[record["round"]] = record
                for hook in hooks:
                    hook.on_round_end(record["round"], RoundRecord.of(record))
        if job["status"] == "running":
            return {}
        return {k: job.get(k) for k in ("status", "reason", "model_path", "best") if job.get(k) is not None}

    def _client_states(self, job_id: str) -> Any:
        """How the Result reads a client's kept state: from the engine's or local aggregator's store,
        or over the broker from the aggregator; opened with FEDMQ_STATE_KEY where the learners seal it."""
        settings, remote_mode = self.settings, self.remote_mode
        kept = Path(settings.state_dir) / ("aggregator" if self.services else "engine")

        def read(client: int, server_round: int) -> Mapping[str, torch.Tensor]:
            from fedmq.common.task.sealing import StateSealer, still_sealed

            if remote_mode:
                from fedmq.services.cli.remote import Remote

                with Remote(settings) as remote:
                    stored = remote.client_state(job_id, client, server_round)
            else:
                from fedmq.common.strategy.clients import ClientStore
                from fedmq.services.aggregator.jobs import RESIDUALS
                from fedmq.services.aggregator.store import JobStore

                stored = ClientStore(JobStore(kept, job_id).root / RESIDUALS).read(client, before=1 << 62)
            if settings.state_key is None:
                still_sealed(stored, client)
                return stored
            return StateSealer(settings.state_key.get_secret_value()).open(stored, job_id, client)

        return read

    def _fetcher(self, job_id: str) -> Any:
        """How the Result gets a round's weights: the aggregator's file here, else over the broker."""
        settings, remote_mode = self.settings, self.remote_mode
        kept = Path(settings.state_dir) / ("aggregator" if self.services else "engine")
        engine = self._engine

        def fetch(digest: str) -> Mapping[str, torch.Tensor]:
            from fedmq.services.aggregator.store import JobStore

            store = JobStore(kept, job_id)
            if not remote_mode and engine and store.find_weights(digest) is None:
                raise LookupError(
                    f"job {job_id}: the engine keeps the models of the rounds it checkpointed (every "
                    f"{settings.checkpoint_every}, the last and the best); this round's is not among them: "
                    "set FEDMQ_CHECKPOINT_EVERY lower to keep more")
            if not remote_mode and store.find_weights(digest) is not None:
                return store.load_weights(digest)
            from fedmq.services.cli.remote import Remote

            with Remote(settings) as remote:
                return remote.model(job_id, digest)

        return fetch


def run(
    job: JobSpec | Mapping[str, Any],
    *,
    broker: str | None = None,
    learners: int = 1,
    state_dir: str | Path | None = None,
    callbacks: Iterable[Callback] = (),
    timeout: float | None = None,
    services: bool = False,
) -> Result:
    """Run one job to its end: in this process (no broker; `services`: on the services' threads
    over an in-memory bus, as deployed), or on the cluster at `broker`."""
    with Runner(broker, learners=learners, state_dir=state_dir, services=services) as runner:
        return runner.run(job, callbacks=callbacks, timeout=timeout)
