"""Typed messages: every type round-trips, and every bad input is one DecodeError."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmq.common import codec
from fedmq.common.errors import DecodeError
from fedmq.common.messages import (
    SCHEMA_VERSION,
    TENSOR_FIELDS,
    AnyMessage,
    BatchMember,
    ClientFailure,
    ClientStateGet,
    ClientStateReply,
    ClientUpdate,
    DdpExit,
    DdpLaunch,
    DdpModel,
    DdpProgress,
    DdpReport,
    DdpStop,
    DdpStored,
    EvalReport,
    EvalTask,
    FailedClient,
    GroupMember,
    GroupUpdate,
    Heartbeat,
    JobCancel,
    JobCreate,
    JobEvent,
    JobFailed,
    JobSubmit,
    Message,
    ModelGet,
    ModelReply,
    RoundClose,
    RoundClosed,
    RoundOpen,
    StatusReply,
    StatusRequest,
    TrainTask,
    TrainTasks,
    UpdateAccepted,
    UpdatesAccepted,
    UserError,
    expect,
    from_wire,
    to_wire,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC = {"name": "job", "clients": {"total": 4}, "rounds": 2, "train": {"lr": 0.1}}


def weights() -> dict[str, torch.Tensor]:
    return {
        "fc.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
        "fc.bias": torch.tensor([1.5, -2.0, 0.25], dtype=torch.float64),
        "bn.num_batches_tracked": torch.tensor(17, dtype=torch.int64),
        "half": torch.tensor([0.1, 0.2], dtype=torch.bfloat16),
        "empty": torch.zeros(0, 5),
    }


DDP_SPEC = {"name": "d", "ddp": {"entry": "examples.ddp:main", "world_size": 2}}
SAMPLES: dict[str, Message] = {
    "job_submit": JobSubmit(job_id="j1", spec=SPEC),
    "job_cancel": JobCancel(job_id="j1", reason="user pressed ctrl-c"),
    "job_create": JobCreate(job_id="j1", spec=SPEC),
    "round_open": RoundOpen(job_id="j1", round=3, clients=[0, 4, 9]),
    "round_close": RoundClose(
        job_id="j1", round=3, clients=[0, 9],
        failed=[FailedClient(client=4, reason="user_code: train raised", phase="train")],
    ),
    "train_task": TrainTask(
        job_id="j1", task_id="j1:3:4", round=3, client=4, model_digest="ab" * 32, spec=SPEC,
        config={"proximal_mu": 0.01, "client_state": True, "note": "x", "k": 3},
    ),
    "train_tasks": TrainTasks(
        job_id="j1", round=3, model_digest="ab" * 32, spec=SPEC, config={"proximal_mu": 0.01},
        members=[BatchMember(task_id="j1:3:4", client=4),
                 BatchMember(task_id="j1:3:7", client=7, state_from=2, state_holder="n/1", state_tag="t")],
    ),
    "eval_task": EvalTask(
        job_id="j1", task_id="j1:e3:4", round=3, client=4, model_digest="ab" * 32, spec=SPEC
    ),
    "eval_report": EvalReport(
        job_id="j1", task_id="j1:e3:4", round=3, client=4, num_examples=30,
        metrics={"perplexity": 3.5}, reduction={"perplexity": "geometric"}, learner="learner-1",
    ),
    "client_update": ClientUpdate(
        job_id="j1",
        task_id="j1:3:4",
        round=3,
        client=4,
        base_digest="ab" * 32,
        num_examples=120,
        metrics={"loss": 0.5, "accuracy": 0.875},
        train_seconds=1.25,
        learner="learner-1",
        weights=weights(),
        extras={"count": torch.tensor([2.0]), "delta.fc": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
    ),
    "client_failure": ClientFailure(
        job_id="j1", task_id="j1:3:4", round=3, client=4, code="oom", reason="out of memory"
    ),
    "update_accepted": UpdateAccepted(
        job_id="j1", round=3, client=4, num_examples=120, metrics={"loss": 0.5}
    ),
    "group_update": GroupUpdate(
        job_id="j1", round=3, base_digest="ab" * 32, learner="learner-1", fetch_bytes=10,
        members=[GroupMember(task_id="j1:3:4", client=4, num_examples=120, metrics={"loss": 0.5}),
                 GroupMember(task_id="j1:3:7", client=7, num_examples=3, train_seconds=0.25)],
        weights={name: torch.stack([t, t]) for name, t in weights().items()},
    ),
    "updates_accepted": UpdatesAccepted(job_id="j1", round=3, updates=[
        UpdateAccepted(job_id="j1", round=3, client=4, num_examples=120, metrics={"loss": 0.5}),
        UpdateAccepted(job_id="j1", round=3, client=7, num_examples=3, bytes=1000),
    ]),
    "round_closed": RoundClosed(
        job_id="j1",
        round=3,
        model_digest="cd" * 32,
        clients=[0, 9],
        num_examples=240,
        metrics={"server": {"loss": 0.3, "accuracy": 0.9}, "train": {"loss": 0.25}},
        aggregate_seconds=0.01,
        model_path="/tmp/model.safetensors",
        config={"proximal_mu": 0.5, "client_state": True},
    ),
    "job_failed": JobFailed(job_id="j1", reason="round 3: 1 of 4 clients reported"),
    "model_get": ModelGet(job_id="j1", digest="ab" * 32),
    "model_reply": ModelReply(job_id="j1", digest="ab" * 32, weights=weights()),
    "client_state_get": ClientStateGet(job_id="j1", round=3, client=4),
    "client_state_reply": ClientStateReply(job_id="j1", round=3, client=4, state=weights()),
    "job_event": JobEvent(job_id="j1", kind="round_completed", round=3, rounds=10, data={"accuracy": 0.9}),
    "heartbeat": Heartbeat(learner="gn6/1", node="gn6", replica=1, device="cuda:1", busy=True, pid=42),
    "status_request": StatusRequest(what="learners"),
    "status_reply": StatusReply(jobs=[{"job_id": "j1", "status": "running"}], learners=[{"rank": 0}]),
    "ddp_launch": DdpLaunch(
        job_id="j1", attempt=1, rank=1, local_rank=0, node_rank=1, world_size=2, master_addr="gn6",
        master_port=29500, backend="gloo", spec=DDP_SPEC, resume_digest="ab" * 32,
    ),
    "ddp_stop": DdpStop(job_id="j1", attempt=1),
    "ddp_exit": DdpExit(job_id="j1", attempt=1, rank=1, learner="gn7/0", node="gn7", code=-9, tail="a\nb"),
    "ddp_progress": DdpProgress(
        job_id="j1", attempt=1, rank=0, learner="gn6/0", node="gn6", lines=["epoch 1/3 loss 2.27"],
        dropped=2, reports=[DdpReport(step=1, total=3, metrics={"loss": 2.27})],
    ),
    "ddp_model": DdpModel(
        job_id="j1", attempt=1, kind="checkpoint", step=3, spec=DDP_SPEC, weights=weights()
    ),
    "ddp_stored": DdpStored(job_id="j1", attempt=1, kind="final", digest="cd" * 32, model_path="/m"),
}
EXTRA_SAMPLES: dict[str, Message] = {
    "model_reply_error": ModelReply(job_id="j1", digest="ff", error="unknown digest"),
    "client_state_reply_error": ClientStateReply(job_id="j1", round=3, client=4, error="unknown job"),
    "client_update_no_tensors": SAMPLES["client_update"].model_copy(update={"weights": {}}),
    "client_failure_user_code": ClientFailure(
        job_id="j1", task_id="j1:3:4", round=3, client=4, code="user_code", reason="train: ValueError: x",
        error=UserError(service="learner", phase="train", type="ValueError", message="x", round=3, client=4),
    ),
    "job_failed_user_code": JobFailed(job_id="j1", reason="evaluate raised", error=UserError(
        service="aggregator", phase="evaluate", type="FloatingPointError", message="overflow", round=2,
    )),
}


def raw_of(msg: Message) -> dict[str, Any]:
    """The decoded msgpack map of a message, to edit before re-encoding."""
    raw = codec.unpackb(to_wire(msg))
    assert isinstance(raw, dict)
    return raw


def assert_same_message(got: Message, sent: Message) -> None:
    assert type(got) is type(sent)
    assert got.model_dump(exclude=set(TENSOR_FIELDS)) == sent.model_dump(exclude=set(TENSOR_FIELDS))
    for field in TENSOR_FIELDS:
        sent_weights = getattr(sent, field, None)
        got_weights = getattr(got, field, None)
        if sent_weights is None:
            assert got_weights is None
            continue
        assert got_weights is not None
        assert list(got_weights) == list(sent_weights), "names and their order survive"
        for name, tensor in sent_weights.items():
            assert got_weights[name].dtype == tensor.dtype
            assert torch.equal(got_weights[name], tensor), name


# --- round trips -----------------------------------------------------------------------------


def test_the_samples_cover_every_message_type() -> None:
    union = typing.get_args(typing.get_args(AnyMessage)[0])
    assert {cls.model_fields["type"].default for cls in union} == set(SAMPLES)


@pytest.mark.parametrize("msg", [*SAMPLES.values(), *EXTRA_SAMPLES.values()], ids=[*SAMPLES, *EXTRA_SAMPLES])
def test_every_message_type_round_trips_through_the_wire(msg: Message) -> None:
    data = to_wire(msg)
    assert isinstance(data, bytes)
    assert_same_message(from_wire(data), msg)


WITH_TENSORS = {"client_update", "group_update", "model_reply", "client_state_reply", "ddp_model"}


@pytest.mark.parametrize("kind", sorted(set(SAMPLES) - WITH_TENSORS))
def test_a_message_without_tensors_decodes_equal_to_the_original(kind: str) -> None:
    assert from_wire(to_wire(SAMPLES[kind])) == SAMPLES[kind]


def test_a_round_trip_keeps_the_envelope_ids_and_timestamp_exactly() -> None:
    msg = JobFailed(job_id="j1", reason="x", sent_at=1_700_000_000.123456789)
    got = from_wire(to_wire(msg))
    assert (got.v, got.msg_id, got.job_id, got.sent_at) == (
        SCHEMA_VERSION,
        msg.msg_id,
        "j1",
        1_700_000_000.123456789,
    )


def test_from_wire_accepts_a_memoryview() -> None:
    msg = SAMPLES["round_open"]
    assert from_wire(memoryview(to_wire(msg))) == msg


def test_each_message_gets_a_fresh_id() -> None:
    assert JobFailed(job_id="j", reason="r").msg_id != JobFailed(job_id="j", reason="r").msg_id


def test_the_message_schemas_decode_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from fedmq.common.messages import JobFailed, from_wire, to_wire\n"
        "msg = JobFailed(job_id='j', reason='r')\n"
        "assert from_wire(to_wire(msg)) == msg\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


# --- decode failures -------------------------------------------------------------------------


def refusal(raw: Any) -> str:
    """The DecodeError message from_wire gives for raw, encoded with the codec."""
    with pytest.raises(DecodeError) as info:
        from_wire(codec.packb(raw))
    return str(info.value)


def test_an_unknown_type_is_a_decode_error() -> None:
    message = refusal({**raw_of(SAMPLES["job_failed"]), "type": "job_explode"})
    assert message.startswith("schema: ")
    assert "job_explode" in message


@pytest.mark.parametrize("field", ["type", "job_id", "reason"])
def test_a_missing_field_is_a_decode_error(field: str) -> None:
    raw = raw_of(SAMPLES["job_failed"])
    del raw[field]
    assert refusal(raw).startswith("schema: ")


def test_a_missing_required_round_names_the_field() -> None:
    raw = raw_of(SAMPLES["round_open"])
    del raw["round"]
    assert refusal(raw) == "schema: round_open.round: Field required"


def test_an_extra_field_is_a_decode_error() -> None:
    raw = {**raw_of(SAMPLES["round_open"]), "priority": 1}
    assert refusal(raw) == "schema: round_open.priority: Extra inputs are not permitted"


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("round_open", "round", "three"),
        ("round_open", "round", -1),
        ("round_open", "clients", ["a"]),
        ("round_open", "clients", 4),
        ("job_failed", "job_id", 5),
        ("job_failed", "job_id", "j" * 129),
        ("job_failed", "msg_id", "m" * 65),
        ("job_failed", "sent_at", "yesterday"),
        ("update_accepted", "metrics", {"loss": "low"}),
        ("update_accepted", "metrics", [0.5]),
        ("update_accepted", "num_examples", 1.5),
        ("client_update", "weights", [1, 2]),
        ("client_update", "weights", {1: torch.ones(1)}),
        ("job_event", "kind", "exploded"),
        ("job_submit", "spec", "name: job"),
        ("round_closed", "metrics", {"server": {"accuracy": "high"}}),
        ("round_closed", "metrics", {"server": 0.9}),
        ("eval_report", "reduction", {"ppl": "median"}),
    ],
)
def test_a_field_of_the_wrong_type_is_a_decode_error(kind: str, field: str, value: Any) -> None:
    message = refusal({**raw_of(SAMPLES[kind]), field: value})
    assert message.startswith(f"schema: {kind}.{field}")


@pytest.mark.parametrize("version", [0, 1, 3, "2", None, [2]])
def test_a_wrong_schema_version_is_a_decode_error(version: Any) -> None:
    message = refusal({**raw_of(SAMPLES["job_failed"]), "v": version})
    assert message == f"unsupported schema version {version!r} (this build reads 2)"


def test_a_missing_schema_version_is_a_decode_error() -> None:
    raw = raw_of(SAMPLES["job_failed"])
    del raw["v"]
    assert refusal(raw) == "unsupported schema version None (this build reads 2)"


@pytest.mark.parametrize("version", [torch.ones(2), torch.zeros(0)], ids=["two", "empty"])
def test_a_tensor_as_schema_version_is_a_decode_error(version: torch.Tensor) -> None:
    refusal({**raw_of(SAMPLES["job_failed"]), "v": version})


@pytest.mark.parametrize("top", [[1, 2], "job_failed", None, 3, 1.5, b"bytes", torch.ones(2)])
def test_a_top_level_that_is_not_a_map_is_a_decode_error(top: Any) -> None:
    assert refusal(top).startswith("message must be a map, got ")


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x81", b"\x82\xa1v\x01", b"not msgpack at all", b"\xde\xff\xff"],
    ids=["empty", "never-used", "truncated-map", "truncated-pair", "text", "huge-map"],
)
def test_garbage_bytes_are_a_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        from_wire(data)


def test_a_truncated_message_is_a_decode_error() -> None:
    data = to_wire(SAMPLES["client_update"])
    with pytest.raises(DecodeError):
        from_wire(data[: len(data) // 2])


def test_trailing_bytes_after_a_message_are_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        from_wire(to_wire(SAMPLES["job_failed"]) + b"\x00")


def test_a_message_over_the_size_limit_is_a_decode_error() -> None:
    data = to_wire(SAMPLES["client_update"])
    with pytest.raises(DecodeError, match="exceeds limit"):
        from_wire(data, max_bytes=len(data) - 1)
    assert_same_message(from_wire(data, max_bytes=len(data)), SAMPLES["client_update"])


def test_input_that_is_not_bytes_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="expected bytes"):
        from_wire("a string")  # type: ignore[arg-type]


# --- expect ----------------------------------------------------------------------------------


def test_expect_returns_the_message_when_it_has_the_expected_type() -> None:
    msg = from_wire(to_wire(SAMPLES["client_failure"]))
    narrowed = expect(msg, ClientFailure)
    assert narrowed is msg
    assert narrowed.code == "oom"


def test_expect_accepts_a_base_class() -> None:
    msg = from_wire(to_wire(SAMPLES["job_failed"]))
    assert expect(msg, Message) is msg


def test_expect_refuses_another_type_with_a_decode_error_naming_it() -> None:
    msg = from_wire(to_wire(SAMPLES["job_failed"]))
    with pytest.raises(DecodeError, match="unexpected message type 'job_failed'"):
        expect(msg, ClientUpdate)


# --- fuzzing ---------------------------------------------------------------------------------

ENCODED = [to_wire(m) for m in [*SAMPLES.values(), *EXTRA_SAMPLES.values()]]

mutation = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "truncate"]),
    st.integers(0, 2**16),  # position, taken modulo the current length
    st.integers(0, 255),
)


def mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, position, value in ops:
        if not buf:
            buf.append(value)
            continue
        i = position % len(buf)
        if op == "flip":
            buf[i] ^= 1 << (value % 8)
        elif op == "set":
            buf[i] = value
        elif op == "insert":
            buf.insert(i, value)
        elif op == "delete":
            del buf[i]
        else:
            del buf[i:]
    return bytes(buf)


def decodes_or_refuses(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        from_wire(data)


@pytest.mark.slow  # a fuzzer: seconds
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, len(ENCODED) - 1), ops=st.lists(mutation, min_size=1, max_size=4))
def test_a_mutated_encoding_decodes_or_raises_only_decode_error(
    index: int, ops: list[tuple[str, int, int]]
) -> None:
    decodes_or_refuses(mutate(ENCODED[index], ops))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64))
def test_random_bytes_decode_or_raise_only_decode_error(data: bytes) -> None:
    decodes_or_refuses(data)


_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) \
    | st.binary(max_size=20)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.slow  # a fuzzer: seconds
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(SAMPLES)),
    version=st.sampled_from([1, 1, 1, 0, 2, "1", True, None]),
    fields=st.dictionaries(
        st.sampled_from(["job_id", "round", "client", "clients", "weights", "spec", "num_examples",
                         "metrics", "digest", "kind", "data", "msg_id", "sent_at", "task_id"]),
        _values, max_size=8,
    ),
)
def test_any_map_with_a_real_type_tag_decodes_or_raises_only_decode_error(
    kind: str, version: object, fields: dict[str, object]
) -> None:
    from fedmq.common import codec

    decodes_or_refuses(codec.packb({"v": version, "type": kind, **fields}))


@pytest.mark.parametrize("metrics", [
    {-5: {"loss": 1.0}},  # no client has a negative id
    {0: {"loss": float("nan")}},  # a metric is a finite number
    {0: {"x" * 500: 1.0}},  # a name of reasonable length
    {c: {"loss": 1.0} for c in range(65)},  # one round of at most 64 clients carries them
], ids=["negative-client", "nan", "long-name", "too-many-clients"])
def test_a_round_closed_whose_client_metrics_break_the_bounds_is_refused(metrics: dict[int, Any]) -> None:
    wire = to_wire(RoundClosed(job_id="j", round=1, model_digest="d"))
    raw = codec.unpackb(wire)
    raw["client_metrics"] = metrics
    with pytest.raises(DecodeError):
        from_wire(codec.packb(raw))


def test_a_round_closed_carries_each_clients_metrics_through_the_wire() -> None:
    msg = RoundClosed(job_id="j", round=1, model_digest="d", clients=[3, 7],
                      client_metrics={3: {"loss": 0.5}, 7: {"loss": 0.25, "accuracy": 1.0}})
    back = from_wire(to_wire(msg))
    assert isinstance(back, RoundClosed) and back.client_metrics == msg.client_metrics
