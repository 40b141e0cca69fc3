"""Typed messages: one envelope shape, a literal type tag and a schema version.

New fields get defaults; existing fields never change type. torch is never
imported here: tensors ride in `weights` as opaque values the codec handles.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from fedmq.common import codec
from fedmq.common.errors import DecodeError

PUSHED_MODEL_MAX = 64 * 1024**2  # the most bytes of a model sent with tasks (FEDMQ_PUSH_MODEL_BYTES' cap)
SCHEMA_VERSION = 2  # 2: metrics of any name (RoundClosed.metrics), federated evaluation
M = TypeVar("M", bound="Message")


def new_id() -> str:
    return uuid.uuid4().hex


class Message(BaseModel):
    """Fields every message carries."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    v: Literal[2] = 2  # SCHEMA_VERSION
    msg_id: str = Field(default_factory=new_id, max_length=64)
    job_id: str = Field(max_length=128)
    sent_at: float = Field(default_factory=time.time)


class JobSubmit(Message):
    """CLI → scheduler: run this job (the spec is validated again on arrival)."""

    type: Literal["job_submit"] = "job_submit"
    spec: dict[str, Any]


class JobCancel(Message):
    type: Literal["job_cancel"] = "job_cancel"
    reason: str = "cancelled by user"


class JobCreate(Message):
    """Scheduler → aggregator: build the initial global model for this job."""

    type: Literal["job_create"] = "job_create"
    spec: dict[str, Any]


class RoundOpen(Message):
    """Scheduler → aggregator: these clients train in this round."""

    type: Literal["round_open"] = "round_open"
    round: NonNegativeInt
    clients: list[NonNegativeInt]
    # The aggregator closes the round itself once every client's update is stored, as the
    # scheduler's RoundClose would (all clients, none failed, `keep` kept), and says so in the
    # announcement of the last ones (UpdatesAccepted.closed): the scheduler then sends no RoundClose.
    close_when_complete: bool = False
    keep: list[str] = Field([], max_length=16)  # as RoundClose.keep: the best round's checkpoint


class FailedClient(BaseModel):
    """A sampled client that sent no update: why, and in which phase (a Task method, a code, "timeout")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    client: NonNegativeInt
    reason: str = Field(max_length=2000)
    phase: str = Field(max_length=64)


class RoundClose(Message):
    """Scheduler → aggregator: fold exactly these clients' updates into the new model."""

    type: Literal["round_close"] = "round_close"
    round: NonNegativeInt
    clients: list[NonNegativeInt]
    failed: list[FailedClient] = []  # the sampled clients that did not report, for the strategy
    # Checkpoints the scheduler still needs whatever FEDMQ_KEEP_CHECKPOINTS says: the best round's.
    keep: list[str] = Field([], max_length=16)


class TrainTask(Message):
    """Scheduler → learners: train one logical client on the round's global model."""

    type: Literal["train_task"] = "train_task"
    task_id: str = Field(max_length=64)
    round: NonNegativeInt
    client: NonNegativeInt
    model_digest: str = Field(max_length=128)
    spec: dict[str, Any]
    config: dict[str, Any] = {}  # what the strategy sends this client this round (Strategy.configure)
    # The client's kept state (learner-made only): the round whose close last folded it (0: none
    # yet) and the learner whose update that was, which may use its own copy (learner/statecache.py).
    # None: unknown, fetch it.
    state_from: NonNegativeInt | None = None
    state_holder: str = Field("", max_length=256)
    state_tag: str = Field("", max_length=64)  # ... and that update's ClientUpdate.state_tag
    # The global model itself, when it is small (FEDMQ_PUSH_MODEL_BYTES): its tensors packed as the
    # codec packs a map of them (relayed as bytes: the scheduler never decodes a tensor). The learner
    # uses it if it hashes to model_digest. b"": fetch it from the aggregator.
    model: bytes = Field(b"", max_length=PUSHED_MODEL_MAX)


TASK_BATCH_MAX = 10_000  # the most tasks one TrainTasks may carry (FEDMQ_TASK_BATCH is at most this)


class BatchMember(BaseModel):
    """One client's part of a TrainTasks: what differs between a round's training tasks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str = Field(max_length=64)
    client: NonNegativeInt
    state_from: NonNegativeInt | None = None
    state_holder: str = Field("", max_length=256)
    state_tag: str = Field("", max_length=64)


class TrainTasks(Message):
    """Scheduler → learners: several clients' training tasks of one round, for one learner to take
    in one delivery. It is acked once every task's reply is published, and goes back to the queue
    whole if any is not (the replies already sent come again as duplicates, which are dropped).
    What the tasks share travels once: the job's spec, the model, the strategy's config."""

    type: Literal["train_tasks"] = "train_tasks"
    round: NonNegativeInt
    model_digest: str = Field(max_length=128)
    spec: dict[str, Any]
    config: dict[str, Any] = {}
    members: list[BatchMember] = Field(min_length=1, max_length=TASK_BATCH_MAX)
    model: bytes = Field(b"", max_length=PUSHED_MODEL_MAX)  # as TrainTask.model

    def tasks(self) -> list[TrainTask]:
        """Its members as the TrainTasks they stand for (built from fields already checked)."""
        return [
            TrainTask.model_construct(
                msg_id=f"{self.msg_id[:48]}:{i}", job_id=self.job_id, sent_at=self.sent_at,
                task_id=m.task_id, round=self.round, client=m.client, model_digest=self.model_digest,
                spec=self.spec, config=dict(self.config),  # a copy each: a Task may write to ctx.config
                state_from=m.state_from, state_holder=m.state_holder, state_tag=m.state_tag, model=self.model,
            )
            for i, m in enumerate(self.members)
        ]


def batch_of(tasks: list[TrainTask]) -> TrainTask | TrainTasks:
    """The one message for `tasks` (of one job, round, model, spec, config and pushed weights): a lone
    task as itself."""
    first = tasks[0]
    if len(tasks) == 1:
        return first
    return TrainTasks(
        job_id=first.job_id, round=first.round, model_digest=first.model_digest, spec=first.spec,
        config=first.config, model=first.model,
        members=[BatchMember(task_id=t.task_id, client=t.client, state_from=t.state_from,
                             state_holder=t.state_holder, state_tag=t.state_tag) for t in tasks],
    )


class EvalTask(Message):
    """Scheduler → learners: evaluate the round's global model on one client's validation data."""

    type: Literal["eval_task"] = "eval_task"
    task_id: str = Field(max_length=64)
    round: NonNegativeInt
    client: NonNegativeInt
    model_digest: str = Field(max_length=128)
    spec: dict[str, Any]
    model: bytes = Field(b"", max_length=PUSHED_MODEL_MAX)  # as TrainTask.model


class ClientUpdate(Message):
    """Learner → aggregator: the client's new weights and what training saw."""

    type: Literal["client_update"] = "client_update"
    task_id: str = Field(max_length=64)
    round: NonNegativeInt
    client: NonNegativeInt
    base_digest: str = Field(max_length=128)
    num_examples: int
    metrics: dict[str, float] = {}
    train_seconds: float = 0.0
    fetch_seconds: float = 0.0  # time spent getting the round's global model
    fetch_bytes: NonNegativeInt = 0  # its size, when it was fetched for this task (not cached)
    learner: str = ""
    # Names this training's state (a random tag): a learner's own copy serves only the one folded.
    state_tag: str = Field("", max_length=64)
    weights: dict[str, Any]  # {} when the job compresses its updates: then `delta` and `compression`
    extras: dict[str, Any] = {}  # name -> tensor: what the Task returned beside them (TrainResult.extras)
    # A compressed update (the job's `compression` section): the encoded delta from the round's
    # global weights and its metadata, as common/codec/compress.py writes them (common/codec/updates.py).
    delta: dict[str, Any] = {}
    compression: dict[str, Any] | None = None


class GroupMember(BaseModel):
    """One client's part of a GroupUpdate: all of its ClientUpdate but the weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str = Field(max_length=64)
    client: NonNegativeInt
    num_examples: int
    metrics: dict[str, float] = {}
    train_seconds: float = 0.0


class GroupUpdate(Message):
    """Learner → aggregator: the updates of clients trained together (train.fuse), in one message.

    Member i's weights are row i of every tensor in `weights` (each [len(members), *shape]); it
    stands for the ClientUpdate that member would have sent (common/groups.py).
    Only uncompressed updates without extras travel so; the rest go one by one.
    """

    type: Literal["group_update"] = "group_update"
    round: NonNegativeInt
    base_digest: str = Field(max_length=128)
    members: list[GroupMember] = Field(min_length=1, max_length=100_000)
    fetch_seconds: float = 0.0
    fetch_bytes: NonNegativeInt = 0
    learner: str = ""
    weights: dict[str, Any]


class EvalReport(Message):
    """Learner → scheduler: a client's evaluation of a global model (no tensors)."""

    type: Literal["eval_report"] = "eval_report"
    task_id: str = Field(max_length=64)
    round: NonNegativeInt
    client: NonNegativeInt
    num_examples: NonNegativeInt
    metrics: dict[str, float] = {}
    # personalize: the client's personal model's metrics on the same data (a `personal` source)
    personal: dict[str, float] = {}
    reduction: dict[str, Literal["mean", "sum", "min", "max", "geometric"]] = {}
    learner: str = ""
    fetch_bytes: NonNegativeInt = 0  # the global model fetched for it (0: from the learner's cache)
    fetch_seconds: float = 0.0


class UserError(BaseModel):
    """Where user code raised and what: which service, phase, round and client, type and message."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    service: str = Field(max_length=32)
    phase: str = Field(max_length=32)
    type: str = Field(max_length=200)
    message: str = Field(max_length=2000)
    round: int | None = None
    client: int | None = None
    learner: str = Field("", max_length=200)
    where: str = Field("", max_length=300)  # the user's line that raised: file:line in function
    trace: str = Field("", max_length=8000)  # its traceback's end (`fedmq run -v` prints it)

    def line(self) -> str:
        """One line for logs, `fedmq status` and `watch`."""
        where = [f"round {self.round}"] if self.round is not None else []
        if self.client is not None:
            where.append(f"client {self.client}")
        if self.learner:
            where.append(f"on {self.learner}")
        place = f" ({', '.join(where)})" if where else ""
        at = f" at {self.where}" if self.where else ""
        return f"user code failed in {self.service} {self.phase}{place}{at}: {self.type}: {self.message}"


class ClientFailure(Message):
    """Learner → scheduler: the client could not train, and why (`error`: its user code raised)."""

    type: Literal["client_failure"] = "client_failure"
    task_id: str = Field(max_length=64)
    round: NonNegativeInt
    client: NonNegativeInt
    code: str
    reason: str
    learner: str = ""
    error: UserError | None = None


class UpdateAccepted(Message):
    """Aggregator → scheduler: this client's update is stored for the round."""

    type: Literal["update_accepted"] = "update_accepted"
    round: NonNegativeInt
    client: NonNegativeInt
    num_examples: int
    metrics: dict[str, float] = {}
    train_seconds: float = 0.0
    fetch_seconds: float = 0.0
    fetch_bytes: NonNegativeInt = 0
    bytes: NonNegativeInt = 0  # the update's size on the wire
    learner: str = Field("", max_length=256)  # who trained it: the scheduler sends the client back there
    state_tag: str = Field("", max_length=64)  # the stored update's ClientUpdate.state_tag


class UpdatesAccepted(Message):
    """Aggregator → scheduler: a GroupUpdate's clients, stored for the round (an UpdateAccepted each)."""

    type: Literal["updates_accepted"] = "updates_accepted"
    round: NonNegativeInt
    updates: list[UpdateAccepted] = Field(min_length=1, max_length=100_000)
    # The round is closed with these (RoundOpen.close_when_complete): its RoundClosed comes next.
    closed: bool = False


CLIENT_METRICS_MAX = 64  # clients a round up to which RoundClosed carries each one's metrics


class RoundClosed(Message):
    """Aggregator → scheduler: the round's new global model and its metrics by source.

    `metrics` is {source: {name: value}} for the sources the aggregator knows: "train" (the
    clients' training metrics, combined), "server" (the new model on the Task's server data),
    "strategy" (what the strategy reports), "transport" (the round's bytes on the wire).
    """

    type: Literal["round_closed"] = "round_closed"
    round: NonNegativeInt
    model_digest: str
    clients: list[NonNegativeInt] = []
    num_examples: int = 0
    metrics: dict[str, dict[str, float]] = {}
    aggregate_seconds: float = 0.0
    model_path: str | None = None
    config: dict[str, bool | int | float | str] = {}  # the next round's (Strategy.configure), for its tasks
    # The new global model, packed, when small enough to go to the learners with the next round's
    # tasks (FEDMQ_PUSH_MODEL_BYTES, no compression.downlink); b"": they fetch it by model_digest.
    model: bytes = Field(b"", max_length=PUSHED_MODEL_MAX)
    # Each client's own training metrics, for rounds of at most CLIENT_METRICS_MAX clients (seed 002's
    # worker_results); {} for larger rounds, whose history would grow by a row of metrics a client.
    client_metrics: Annotated[
        dict[NonNegativeInt, Annotated[dict[Annotated[str, Field(max_length=128)],
                                            Annotated[float, Field(allow_inf_nan=False)]],
                                       Field(max_length=256)]],
        Field(max_length=CLIENT_METRICS_MAX),
    ] = {}


class JobFailed(Message):
    """Any service → scheduler: the job cannot go on."""

    type: Literal["job_failed"] = "job_failed"
    reason: str
    error: UserError | None = None  # set when user code raised


class ModelGet(Message):
    """Learner → aggregator (request/reply): send me the weights with this digest (`downlink`:
    rounded as the job's compression.downlink says; none: exact, as the CLI downloads it)."""

    type: Literal["model_get"] = "model_get"
    digest: str = Field(max_length=128)
    downlink: Literal["none", "bfloat16"] = "none"


class ModelReply(Message):
    type: Literal["model_reply"] = "model_reply"
    digest: str
    weights: dict[str, Any] | None = None
    error: str | None = None


class ClientStateGet(Message):
    """Learner → aggregator (request/reply): the strategy's stored state of this client, for this round."""

    type: Literal["client_state_get"] = "client_state_get"
    round: NonNegativeInt
    client: NonNegativeInt


class ClientStateReply(Message):
    type: Literal["client_state_reply"] = "client_state_reply"
    round: NonNegativeInt
    client: NonNegativeInt
    state: dict[str, Any] | None = None  # name -> tensor ({} when the client has none yet)
    error: str | None = None


SiteName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")]  # as common/sites.SITE_NAME


class Heartbeat(Message):
    """Learner → scheduler, every few seconds: I am alive, here, on this device, busy or idle."""

    type: Literal["heartbeat"] = "heartbeat"
    job_id: str = ""
    learner: str = Field(max_length=200)
    node: str = Field(max_length=200)
    replica: NonNegativeInt
    device: str = Field(max_length=32)
    busy: bool = False
    pid: int = 0
    interval_s: float = 5.0
    # the sites it hosts (FEDMQ_SITES); the names as common/sites.SITE_NAME allows
    sites: list[SiteName] = Field([], max_length=1000)
    group: str = Field("", max_length=200)  # the DDP group it runs a rank of: job/attempt ("": none)
    leaving: bool = False  # its last: it stopped (SIGTERM, Ctrl-C), it is not lost


class StatusRequest(Message):
    """CLI → scheduler (request/reply): jobs, one job's rounds, or the learner registry."""

    type: Literal["status_request"] = "status_request"
    job_id: str = ""
    what: Literal["jobs", "job", "learners"] = "jobs"


class StatusReply(Message):
    type: Literal["status_reply"] = "status_reply"
    job_id: str = ""
    jobs: list[dict[str, Any]] = []
    learners: list[dict[str, Any]] = []
    fleet: dict[str, Any] = {}  # learners alive, busy, and the names of those lost
    error: str | None = None


class DdpLaunch(Message):
    """Scheduler → one learner (its own queue): start rank `rank` of a DDP group's attempt."""

    type: Literal["ddp_launch"] = "ddp_launch"
    attempt: NonNegativeInt
    rank: NonNegativeInt
    local_rank: NonNegativeInt
    node_rank: NonNegativeInt
    world_size: int = Field(gt=0)
    master_addr: str = Field(max_length=253)
    master_port: int = Field(gt=0, lt=65536)
    backend: Literal["gloo", "nccl"]
    spec: dict[str, Any]
    resume_digest: str = Field("", max_length=128)  # the checkpoint to start from ("" : none)


class DdpStop(Message):
    """Scheduler → one learner: end its rank of this attempt (the group is torn down)."""

    type: Literal["ddp_stop"] = "ddp_stop"
    attempt: NonNegativeInt


class DdpExit(Message):
    """Learner → scheduler: its rank's process ended, with this exit code (and its last output)."""

    type: Literal["ddp_exit"] = "ddp_exit"
    attempt: NonNegativeInt
    rank: NonNegativeInt
    learner: str = Field(max_length=200)
    node: str = Field(max_length=200)
    code: int
    tail: str = Field("", max_length=8000)


class DdpReport(BaseModel):
    """What rank 0's entry reported at a step (fedmq.ddp.report)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: NonNegativeInt
    total: int | None = Field(None, gt=0)
    metrics: dict[str, Annotated[float, Field(allow_inf_nan=False)]] = Field({}, max_length=64)


class DdpProgress(Message):
    """Learner → scheduler: what a rank printed (any rank) and reported (rank 0) since its last one."""

    type: Literal["ddp_progress"] = "ddp_progress"
    attempt: NonNegativeInt
    rank: NonNegativeInt
    learner: str = Field(max_length=200)
    node: str = Field(max_length=200)
    lines: list[Annotated[str, Field(max_length=1000)]] = Field([], max_length=200)
    dropped: NonNegativeInt = 0  # lines left out before these: the rank printed faster than they went
    reports: list[DdpReport] = Field([], max_length=200)


class DdpModel(Message):
    """Rank 0's learner → aggregator: a checkpoint the entry saved, or its final model."""

    type: Literal["ddp_model"] = "ddp_model"
    attempt: NonNegativeInt
    kind: Literal["checkpoint", "final"]
    step: int = 0
    spec: dict[str, Any]
    weights: dict[str, Any]


class DdpStored(Message):
    """Aggregator → scheduler: a DDP job's checkpoint or final model is stored under this digest."""

    type: Literal["ddp_stored"] = "ddp_stored"
    attempt: NonNegativeInt
    kind: Literal["checkpoint", "final"]
    step: int = 0
    digest: str = Field(max_length=128)
    model_path: str = ""


EventKind = Literal[
    "accepted", "round_started", "round_completed", "progress", "completed", "failed", "cancelled"
]


class JobEvent(Message):
    """Scheduler → anyone watching: what happened to a job."""

    type: Literal["job_event"] = "job_event"
    kind: EventKind
    round: int | None = None
    rounds: int | None = None
    data: dict[str, Any] = {}


AnyMessage = Annotated[
    JobSubmit
    | JobCancel
    | JobCreate
    | RoundOpen
    | RoundClose
    | TrainTask
    | TrainTasks
    | EvalTask
    | ClientUpdate
    | EvalReport
    | ClientFailure
    | UpdateAccepted
    | RoundClosed
    | GroupUpdate
    | UpdatesAccepted
    | JobFailed
    | ModelGet
    | ModelReply
    | ClientStateGet
    | ClientStateReply
    | JobEvent
    | Heartbeat
    | StatusRequest
    | StatusReply
    | DdpLaunch
    | DdpStop
    | DdpExit
    | DdpProgress
    | DdpModel
    | DdpStored,
    Field(discriminator="type"),
]
_adapter: TypeAdapter[Message] = TypeAdapter(AnyMessage)


TENSOR_FIELDS = ("weights", "extras", "state", "delta")  # name -> tensor maps, encoded as they are
# Fields added to a message type after its schema version: left off the wire while they hold their
# default, so a build from before them, which refuses unknown fields, still reads the message.
NEWER_FIELDS = {"model": b"", "downlink": "none", "close_when_complete": False, "keep": [], "closed": False}


def to_wire(msg: Message) -> bytes:
    """Encode a message; tensors inside its tensor fields go through the codec's tensor extension."""
    return to_wire_parts(msg).join()


def to_wire_parts(msg: Message) -> codec.Encoded:
    """to_wire's encoding as parts that view the message's tensors: a large message is published
    chunk by chunk from them, never joined into one copy (keep the tensors unchanged till then)."""
    fields = msg.model_dump(exclude=set(TENSOR_FIELDS))
    for name, default in NEWER_FIELDS.items():
        if name in fields and fields[name] == default:
            del fields[name]
    for name in TENSOR_FIELDS:
        if name in type(msg).model_fields:
            fields[name] = getattr(msg, name)
    return codec.packb_parts(fields)


def from_wire(
    data: bytes | bytearray | memoryview | codec.Encoded, *, max_bytes: int = codec.DEFAULT_MAX_BYTES
) -> Message:
    """Decode and schema-check a message (bytes, or an encoding still in parts); anything wrong
    raises DecodeError."""
    if isinstance(data, codec.Encoded):
        data = data.join()
    return _validated(codec.unpackb(data, max_bytes=max_bytes))


def _validated(raw: Any) -> Message:
    if not isinstance(raw, dict):
        raise DecodeError(f"message must be a map, got {type(raw).__name__}")
    version = raw.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise DecodeError(f"unsupported schema version {version!r} (this build reads {SCHEMA_VERSION})")
    try:
        return _adapter.validate_python(raw)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise DecodeError(f"schema: {where}: {first['msg']}") from None


SMALL_FILE = 64 * 1024 * 1024


def from_wire_file(path: str | os.PathLike[str], *, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> Message:
    """Decode a message kept in a file; a large one's tensors stay on disk until read.

    Over SMALL_FILE bytes the message must carry `weights`, which come back as a
    lazy `codec.TensorFile`: each tensor is read when it is looked up, so a
    200 MB update is checked and folded one tensor at a time.
    """
    size = os.stat(path).st_size
    if size > max_bytes:
        raise DecodeError(f"message of {size} bytes exceeds limit of {max_bytes}")
    if size <= SMALL_FILE:
        with open(path, "rb") as f:
            return from_wire(f.read(), max_bytes=max_bytes)
    tensors = codec.index_tensors(path, "weights", max_bytes=max_bytes)
    msg = _validated({**tensors.fields, "weights": {}})
    return msg.model_copy(update={"weights": tensors})


def expect(msg: Message, kind: type[M]) -> M:
    """Narrow a decoded message to the type a queue carries, or raise DecodeError."""
    if not isinstance(msg, kind):
        raise DecodeError(f"unexpected message type {msg.type!r}")  # type: ignore[attr-defined]
    return msg
