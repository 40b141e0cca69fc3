"""A closed round's record keeps why its missing clients sent nothing, bounded (the console shows it)."""

from __future__ import annotations

from fedmq.common.messages import RoundClosed
from fedmq.services.scheduler.records import FAILURE_REASON_CHARS, FAILURES_KEPT, round_record


def closed() -> RoundClosed:
    return RoundClosed(job_id="j", round=4, model_digest="d" * 64, clients=[0, 1])


def test_a_round_without_failures_records_none() -> None:
    assert "failures" not in round_record(closed(), {}, clients=2, failed=0, seconds=1.0)


def test_failures_are_kept_in_order_cut_to_a_bound() -> None:
    missing = [(c, f"reason {c} " + "x" * 1000, "train") for c in range(2, 2 + FAILURES_KEPT + 5)]
    record = round_record(closed(), {}, clients=2, failed=len(missing), seconds=1.0, failures=missing)
    kept = record["failures"]
    assert [f["client"] for f in kept] == list(range(2, 2 + FAILURES_KEPT))
    assert all(len(f["reason"]) == FAILURE_REASON_CHARS and f["phase"] == "train" for f in kept)
    assert kept[0]["reason"].startswith("reason 2 ")
    assert record["failed"] == FAILURES_KEPT + 5  # the count stays whole
