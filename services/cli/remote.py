"""The CLI's side of a running cluster: one RabbitMQ connection, requests and events."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any, Literal

from rich.table import Column, Table

from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.bus.factory import bus_of_process
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.errors import DecodeError, FedmqError
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import Message, StatusReply, StatusRequest, expect, from_wire, to_wire
from fedmq.common.settings import Settings
from fedmq.services.cli.follow import JobFollower
from fedmq.services.cli.summary import flat, headline

STATUS_TIMEOUT_S = 10.0
PREFLIGHT_TIMEOUT_S = 5.0  # `submit` asks for the learners this long, then publishes anyway


class SchedulerSilent(FedmqError):
    """The broker is up but no scheduler answered."""


class AggregatorSilent(FedmqError):
    """The broker is up but no aggregator answered a model request."""


class UnknownJob(FedmqError):
    """The scheduler has no job of that id (its words)."""


class ModelUnavailable(FedmqError):
    """The aggregator answered without the model; `reason` is its word ("unknown job", "unknown model")."""

    def __init__(self, job_id: str, digest: str, reason: str) -> None:
        super().__init__(f"the aggregator has no model {digest[:12]} of job {job_id}: {reason}")
        self.reason = reason


class Remote:
    """A connected CLI client; use as a context manager. BrokerUnavailable if unreachable.

    `bus`: one that another thread already runs (an embedded cluster's, a test's), to ask on
    instead of a RabbitMQ connection of its own; the `with` block then neither opens nor stops it.
    """

    def __init__(self, settings: Settings, bus: Bus | None = None, name: str = "fedmq-cli") -> None:
        self.settings = settings
        self._own: RabbitBus | None = None
        if bus is None:
            bus = self._own = bus_of_process(settings, name)
        self.bus = bus
        self._thread = threading.Thread(target=self.bus.run, name="cli-bus", daemon=True)

    def __enter__(self) -> Remote:
        if self._own is not None:
            self._own.connect()
            self._thread.start()
            self._own.wait_ready(self.settings.request_timeout_s)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._own is not None:
            self._own.stop()
            self._thread.join(timeout=5)

    def send(self, msg: Message) -> None:
        """Publish to the scheduler; returns once the broker confirmed it."""
        self.bus.publish(topology.SCHEDULER, to_wire(msg))

    def submit(self, spec: JobSpec, job_id: str) -> str | None:
        """`fedmq submit`'s sending of a checked spec: the learners' warning (never a refusal), then
        JobSubmit, returned once the broker confirmed it."""
        from fedmq.common.messages import JobSubmit

        warning = self.ask_learners(spec)
        self.send(JobSubmit(job_id=job_id, spec=spec.model_dump(mode="json")))
        return warning

    def ask_learners(self, spec: JobSpec) -> str | None:
        """What the scheduler's learner registry says of the job's chances; never a refusal, and a
        silent scheduler is a warning too (the job waits in the broker's queue)."""
        from fedmq.services.cli.preflight import learners_warning

        try:
            reply = self.status("learners", timeout=PREFLIGHT_TIMEOUT_S)
        except SchedulerSilent:
            return (f"no scheduler answered within {PREFLIGHT_TIMEOUT_S:g} s: the job waits in the broker's "
                    "queue until `fedmq scheduler` runs against this broker and vhost")
        return learners_warning(spec, reply.learners)

    def cancel(self, job_id: str, reason: str | None = None) -> str | None:
        """`fedmq cancel`: JobCancel for a running job; None once sent, else why nothing was (it is no
        longer running). UnknownJob if the scheduler has no such job (it would drop the cancel)."""
        from fedmq.common.messages import JobCancel

        reply = self.status("job", job_id)
        if reply.error or not reply.jobs:
            raise UnknownJob(reply.error or f"no job {job_id!r}")
        state = reply.jobs[0]["status"]
        if state != "running":
            return f"job {job_id} is no longer running ({state}): nothing to cancel"
        self.send(JobCancel(job_id=job_id) if reason is None else JobCancel(job_id=job_id, reason=reason))
        return None

    def status(
        self, what: Literal["jobs", "job", "learners"] = "jobs", job_id: str = "",
        timeout: float = STATUS_TIMEOUT_S,
    ) -> StatusReply:
        request = StatusRequest(job_id=job_id, what=what)
        try:
            body = self.bus.request(topology.SCHEDULER, to_wire(request), timeout=timeout)
        except TimeoutError:
            raise SchedulerSilent(
                f"no scheduler answered within {timeout:.0f}s on {self.settings.safe_broker_url}; "
                "is `fedmq scheduler` running against this broker and vhost?"
            ) from None
        try:
            return expect(from_wire(body), StatusReply)
        except DecodeError as exc:
            raise SchedulerSilent(f"unreadable answer from the scheduler: {exc}") from None

    def model(self, job_id: str, digest: str) -> dict[str, Any]:
        """A job's global weights by digest, from the aggregator (the same request learners make).

        AggregatorSilent if none answers in FEDMQ_REQUEST_TIMEOUT_S; ModelUnavailable if it has not
        the model (a round FEDMQ_KEEP_CHECKPOINTS pruned, a job it does not hold).
        """
        from fedmq.common.messages import ModelGet, ModelReply

        reply = expect(self._ask_aggregator(to_wire(ModelGet(job_id=job_id, digest=digest))), ModelReply)
        if reply.error or reply.weights is None:
            raise ModelUnavailable(job_id, digest, reply.error or "no weights")
        return dict(reply.weights)

    def client_state(self, job_id: str, client: int, server_round: int) -> dict[str, Any]:
        """A client's kept state before `server_round`, from the aggregator (the learners' request):
        as stored, sealed when the learners seal it. FedmqError when the aggregator has none to give."""
        from fedmq.common.messages import ClientStateGet, ClientStateReply

        request = to_wire(ClientStateGet(job_id=job_id, round=server_round, client=client))
        reply = expect(self._ask_aggregator(request), ClientStateReply)
        if reply.error or reply.state is None:
            raise FedmqError(f"job {job_id}: client {client}'s state unavailable: {reply.error}")
        return dict(reply.state)

    def _ask_aggregator(self, request: bytes) -> Message:
        """The aggregator's answer to a request on its model queue (what learners ask too);
        AggregatorSilent if none comes in FEDMQ_REQUEST_TIMEOUT_S."""
        timeout = self.settings.request_timeout_s
        try:
            body = self.bus.request(topology.MODEL, request, timeout=timeout)
        except TimeoutError:
            raise AggregatorSilent(
                f"no aggregator answered within {timeout:.0f}s on {self.settings.safe_broker_url}; "
                "is `fedmq aggregator` running against this broker and vhost?"
            ) from None
        return from_wire(body, max_bytes=self.settings.max_message_bytes)

    def follow(self, job_id: str) -> JobFollower:
        """Events of one job, subscribed on this connection (started before anything is asked)."""
        return JobFollower(self.bus, job_id).attach()


def job_row(job: dict[str, Any]) -> list[str]:
    """A row of `fedmq status`: the job's headline metric (its objective's, where it has one)."""
    shown = headline({"metrics": job.get("metrics") or {}}, (job.get("objective") or {}).get("metric"))
    return [
        str(job.get("job_id", "-")), str(job.get("status", "-")),
        f"{job.get('round', '-')}/{job.get('rounds', '-')}",
        "-" if shown is None else f"{shown[0]} {number_cell(shown[1])}", (job.get("reason") or "")[:60],
    ]


def number_cell(value: Any, digits: int = 4) -> str:
    """A metric or a time as the tables show it; "-" for what is no number (an older scheduler's None)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return f"{value:.{digits}f}"


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    """`fedmq status`: a row per job; the job id is never cut or wrapped (it is there to be copied)."""
    widest = max((len(job["job_id"]) for job in jobs), default=3)
    table = Table(Column("job", no_wrap=True, min_width=widest), "status", "round", "metric", "reason")
    for job in jobs:
        table.add_row(*job_row(job))
    return table


def rounds_table(history: list[dict[str, Any]]) -> Table:
    """One job's rounds: a column per metric any round reported (source.name), then timing."""
    header, rows = round_cells(history)
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    return table


def round_cells(history: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The rounds as text cells (the CLI's table and the console's): round, clients, failed, a column
    per metric any round reported (source.name, "-" where a round has none), seconds."""
    names = sorted({name for record in history for name in flat(record)})
    rows = []
    for record in history:
        metrics = flat(record)
        rows.append([
            str(record["round"]), str(record.get("clients", "-")), str(record.get("failed", "-")),
            *(number_cell(metrics.get(n)) for n in names), number_cell(record.get("seconds", 0.0), 2),
        ])
    return ["round", "clients", "failed", *names, "seconds"], rows
