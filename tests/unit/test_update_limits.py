"""Plausible updates and the aggregator's limits: example counts bounded, update norms bounded,
the model's size, a job's disk, and which checkpoints are kept (services/aggregator/limits.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmq.common.codec.compress import CompressionSpec
from fedmq.common.errors import ValidationError
from fedmq.common.messages import ClientUpdate
from fedmq.services.aggregator import limits
from fedmq.services.aggregator.limits import DiskQuota, OverLimit, check_model, folder_bytes, retained
from fedmq.services.aggregator.validation import check_update
from fedmq.services.learner.work import compressed
from tests.conftest import small_job


def model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(3, 4), "b": torch.zeros(4), "steps": torch.tensor(2)}


def update(delta: float = 0.0, **changes: Any) -> ClientUpdate:
    """An update whose floating tensors moved by `delta` each: its norm is delta * sqrt(16)."""
    weights = {k: v + delta if v.is_floating_point() else v + 5 for k, v in model().items()}
    fields: dict[str, Any] = dict(job_id="j", task_id="t", round=1, client=0, base_digest="d",
                                  num_examples=10, weights=weights)
    return ClientUpdate(**(fields | changes))


def reason(**kwargs: Any) -> str:
    with pytest.raises(ValidationError) as info:
        check_update(reference=model(), **kwargs)
    return info.value.reason


def test_an_example_count_over_the_clients_bound_is_implausible() -> None:
    check_update(update(num_examples=10), model(), max_examples=10)
    assert reason(update=update(num_examples=11), max_examples=10) == "implausible_examples"
    assert reason(update=update(num_examples=0), max_examples=10) == "bad_example_count"


def test_an_update_norm_over_the_bound_is_refused_and_one_at_it_passes() -> None:
    check_update(update(delta=0.25), model(), max_norm=1.0)  # norm 0.25 * 4 = 1.0: at the bound
    with pytest.raises(ValidationError, match=r"update norm 1\.2 is over clients.max_update_norm \(1\)"):
        check_update(update(delta=0.3), model(), max_norm=1.0)
    check_update(update(delta=100.0), model())  # no bound: any finite update


def test_a_clients_state_rides_only_where_its_job_keeps_it_and_only_as_a_learner_makes_it() -> None:
    kept = {"fedmq.state.i.visits": torch.tensor(3), "fedmq.state.t.m": torch.zeros(3, 4)}
    check_update(update(extras=kept), model(), task_state=True)
    assert reason(update=update(extras=kept)) == "bad_state"  # the job keeps none
    floating = {"fedmq.state.i.visits": torch.tensor(3.0)}  # an int kept as a float
    assert reason(update=update(extras=floating), task_state=True) == "bad_state"
    huge = {"fedmq.state.t.m": torch.zeros(1 << 19)}  # 2 MiB: over four models (~0.1 kB) and 1 MiB
    assert reason(update=update(extras=huge), task_state=True) == "bad_state"
    stray = {"fedmq.other.x": torch.zeros(1)}
    assert reason(update=update(extras=stray), task_state=True) == "bad_compression"


def test_a_compressed_update_is_bounded_by_its_decoded_norm() -> None:
    int8 = CompressionSpec(codec="int8")
    scaled = compressed(update(delta=0.5), model(), int8, None)
    assert reason(update=scaled, compression=int8, max_norm=1.0) == "update_norm"
    check_update(scaled, model(), compression=int8, max_norm=2.0 + 1e-3)


def test_the_spec_fields_default_to_no_bound_and_refuse_nonsense() -> None:
    clients = small_job().clients
    assert (clients.max_examples, clients.max_update_norm, clients.on_large_update) == (None, None, "reject")
    for bad in ({"clients__max_update_norm": math.inf}, {"clients__max_examples": 0},
                {"clients__on_large_update": "ignore"}):
        with pytest.raises(Exception, match="clients"):
            small_job(**bad)


def test_a_model_over_the_deployment_limit_is_refused_naming_the_setting() -> None:
    check_model(model(), 72)  # 12 + 4 floats and one int64: 72 bytes
    with pytest.raises(OverLimit, match=r"72 bytes of tensors, more than this deployment allows \(71, "
                                        r"FEDMQ_MAX_MODEL_BYTES\)") as info:
        check_model(model(), 71)
    assert info.value.limit == "model_bytes"


def test_the_disk_quota_counts_what_is_there_and_what_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    DiskQuota(tmp_path, 1000 + limits.BOOKKEEPING_BYTES).need(1000, "an update")  # fits
    with pytest.raises(OverLimit):  # the room kept for the job's small files is not given away
        DiskQuota(tmp_path, 1000 + limits.BOOKKEEPING_BYTES).need(1001, "an update")
    monkeypatch.setattr(limits, "BOOKKEEPING_BYTES", 0)  # the count itself, below
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"x" * 300)
    (tmp_path / "y").write_bytes(b"y" * 200)
    assert folder_bytes(tmp_path) == 500 and folder_bytes(tmp_path / "none") == 0
    quota = DiskQuota(tmp_path, 1000)
    quota.need(400, "an update")
    (tmp_path / "u").write_bytes(b"u" * 400)  # as the aggregator writes what it counted
    assert quota.used == 900
    message = r"an update \(101 bytes\) would take the job's aggregator state to 1001 bytes, over its quota"
    with pytest.raises(OverLimit, match=message + r" \(1000, FEDMQ_JOB_DISK_BYTES\)"):
        quota.need(101, "an update")
    (tmp_path / "y").unlink()  # deleted: the count still holds it, the folder is walked before refusing
    quota.need(300, "a checkpoint")
    assert quota.used == 1000
    (tmp_path / "z").write_bytes(b"z" * 300)
    with pytest.raises(OverLimit, match="to 1001 bytes"):  # nothing deleted this time: the walk agrees
        quota.need(1, "an update")


def test_retention_keeps_the_last_rounds_and_what_the_scheduler_names() -> None:
    rounds = {0: "a", 1: "b", 2: "c", 3: "b", 4: "d"}  # round 3 came back to round 1's weights
    assert retained(rounds, 4, 2, []) == {"b", "d"}
    assert retained(rounds, 4, 1, ["a"]) == {"a", "d"}
    assert retained(rounds, 4, 0, []) == {"a", "b", "c", "d"}, "0 keeps every round's"


def test_the_norm_bound_measures_what_a_client_changed_from_the_rounded_model_it_got() -> None:
    from fedmq.common.codec.compress import downlinked, widened

    exact = {"w": torch.tensor([0.1, -0.3, 1e-3, 7.77]), "b": torch.tensor([0.123])}
    rounded = widened(downlinked(exact, "bfloat16"), exact)
    assert any(not torch.equal(rounded[n], exact[n]) for n in exact)
    unchanged = update(weights=rounded)
    check_update(unchanged, exact, compression=CompressionSpec(downlink="bfloat16"), max_norm=1e-12)
    with pytest.raises(ValidationError, match="update_norm"):  # without a downlink, the rounding is a change
        check_update(unchanged, exact, max_norm=1e-12)
    moved = update(weights={n: t + 0.5 for n, t in rounded.items()})
    with pytest.raises(ValidationError, match="update_norm"):
        check_update(moved, exact, compression=CompressionSpec(downlink="bfloat16"), max_norm=0.9)
