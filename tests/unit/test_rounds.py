"""The pure round state (who reported, who failed, is it done) and seeded client sampling."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmq.services.scheduler.loop import round_close
from fedmq.services.scheduler.rounds import Decision, RoundState
from fedmq.services.scheduler.sampling import sample_clients
from fedmq.services.scheduler.store import _state_from_row, _state_row

DEADLINE = 100.0
BEFORE = 50.0


def new_round(clients: tuple[int, ...] = (1, 3, 5, 7), quorum: int = 3, retries: int = 1) -> RoundState:
    return RoundState(round=4, clients=list(clients), quorum=quorum, deadline=DEADLINE, retries_left=retries)


def report(state: RoundState, *clients: int) -> None:
    for client in clients:
        assert state.record_update(client, num_examples=10 * client)


# --- decisions -------------------------------------------------------------------------------


def test_a_fresh_round_waits() -> None:
    assert new_round().decide(BEFORE) is Decision.WAIT


def test_a_round_closes_as_soon_as_every_sampled_client_reported() -> None:
    state = new_round()
    report(state, 1, 3, 5, 7)
    assert state.decide(BEFORE) is Decision.CLOSE
    assert state.reported == {1: 10, 3: 30, 5: 50, 7: 70}
    assert state.missing == []


def test_a_round_waits_before_the_deadline_while_clients_are_missing() -> None:
    state = new_round(quorum=2)
    report(state, 1, 3, 5)
    assert state.decide(BEFORE) is Decision.WAIT, "quorum alone does not close before the deadline"
    assert state.missing == [7]


@pytest.mark.parametrize("now", [DEADLINE, DEADLINE + 1.0])
def test_a_round_at_or_after_its_deadline_closes_with_a_quorum(now: float) -> None:
    state = new_round(quorum=3)
    report(state, 1, 5, 7)
    assert state.decide(now) is Decision.CLOSE


def test_a_round_at_its_deadline_below_quorum_retries_while_retries_are_left() -> None:
    state = new_round(quorum=3, retries=1)
    report(state, 1, 5)
    assert state.decide(DEADLINE) is Decision.RETRY


def test_a_round_at_its_deadline_below_quorum_fails_without_retries() -> None:
    state = new_round(quorum=3, retries=0)
    report(state, 1, 5)
    assert state.decide(DEADLINE) is Decision.FAIL


def test_a_round_retries_then_fails_when_the_retry_also_falls_short() -> None:
    state = new_round(quorum=3, retries=1)
    report(state, 1)
    assert state.decide(DEADLINE) is Decision.RETRY
    state.retry(deadline=2 * DEADLINE)
    report(state, 3)
    assert state.decide(DEADLINE + 1.0) is Decision.WAIT, "the new deadline applies"
    assert state.decide(2 * DEADLINE) is Decision.FAIL


def test_a_round_closes_on_retry_once_the_missing_clients_report() -> None:
    state = new_round(quorum=4, retries=1)
    report(state, 1, 3)
    assert state.decide(DEADLINE) is Decision.RETRY
    assert state.retry(deadline=2 * DEADLINE) == [5, 7]
    report(state, 5, 7)
    assert state.decide(DEADLINE + 1.0) is Decision.CLOSE


def test_all_settled_below_quorum_retries_before_the_deadline_without_waiting() -> None:
    state = new_round(quorum=3, retries=2)
    report(state, 1, 3)
    assert state.record_failure(5, "oom")
    assert state.decide(BEFORE) is Decision.WAIT, "client 7 has not settled yet"
    assert state.record_failure(7, "crashed")
    assert state.decide(BEFORE) is Decision.RETRY


def test_all_settled_below_quorum_fails_before_the_deadline_without_retries() -> None:
    state = new_round(quorum=3, retries=0)
    report(state, 1)
    for client in (3, 5, 7):
        assert state.record_failure(client, "no data")
    assert state.decide(BEFORE) is Decision.FAIL


def test_all_settled_with_a_quorum_closes_before_the_deadline() -> None:
    state = new_round(quorum=3)
    report(state, 1, 3, 5)
    state.record_failure(7, "oom")
    assert state.decide(BEFORE) is Decision.CLOSE


# --- what is counted -------------------------------------------------------------------------


def test_a_duplicate_update_is_not_counted_and_keeps_the_first_example_count() -> None:
    state = new_round()
    assert state.record_update(3, num_examples=30)
    assert not state.record_update(3, num_examples=999)
    assert state.reported == {3: 30}


def test_an_update_from_a_client_that_was_not_sampled_is_not_counted() -> None:
    state = new_round()
    assert not state.record_update(2, num_examples=10)
    assert state.reported == {}


def test_a_failure_from_a_client_that_was_not_sampled_is_not_counted() -> None:
    state = new_round()
    assert not state.record_failure(2, "oom")
    assert state.failed == {}


def test_a_failure_after_an_update_from_the_same_client_is_not_counted() -> None:
    state = new_round()
    report(state, 3)
    assert not state.record_failure(3, "late crash")
    assert state.failed == {}
    assert state.reported == {3: 30}


def test_an_update_after_a_failure_counts_and_clears_the_failure() -> None:
    state = new_round()
    assert state.record_failure(3, "oom")
    assert state.record_update(3, num_examples=30)
    assert state.failed == {}
    assert state.reported == {3: 30}


def test_strangers_and_duplicates_do_not_make_a_round_complete() -> None:
    state = new_round(clients=(1, 2), quorum=2)
    report(state, 1)
    assert not state.record_update(1, num_examples=10)
    assert not state.record_update(9, num_examples=10)
    assert state.decide(BEFORE) is Decision.WAIT


def test_a_closing_round_waits_and_refuses_updates_and_failures() -> None:
    state = new_round()
    report(state, 1, 3, 5)
    state.closing = True
    assert state.decide(DEADLINE + 10.0) is Decision.WAIT
    assert not state.record_update(7, num_examples=70)
    assert not state.record_failure(7, "oom")
    assert state.reported == {1: 10, 3: 30, 5: 50}
    assert state.failed == {}


def test_retry_returns_the_missing_clients_in_sampled_order_and_uses_up_a_retry() -> None:
    state = new_round(clients=(7, 1, 5, 3), retries=2)
    report(state, 5)
    state.record_failure(1, "oom")
    missing = state.retry(deadline=250.0)
    assert missing == [7, 1, 3]
    assert state.retries_left == 1
    assert state.deadline == 250.0
    assert state.failed == {}, "failed clients get another chance"
    assert state.reported == {5: 50}, "accepted updates are kept"


# --- sampling --------------------------------------------------------------------------------


# --- what the strategy hears of the clients that did not report ----------------------------------


def test_the_round_close_names_each_unreported_client_with_its_reason_and_phase() -> None:
    state = new_round()
    report(state, 1, 5)
    assert state.record_failure(3, "user_code: train raised", "train")
    close = round_close("j", state)
    assert (close.round, close.clients) == (4, [1, 5])
    assert [(f.client, f.reason, f.phase) for f in close.failed] == [
        (3, "user_code: train raised", "train"), (7, "no update by the round's deadline", "timeout")]


def test_an_update_after_a_failure_clears_its_phase_and_a_retry_forgets_failures() -> None:
    state = new_round()
    state.record_failure(3, "invalid: x", "invalid")
    report(state, 3)
    assert state.phases == {} and [c for c, _, _ in state.unreported()] == [1, 5, 7]
    state.record_failure(1, "error: y", "error")
    state.retry(DEADLINE * 2)
    assert state.phases == {} and all(p == "timeout" for _, _, p in state.unreported())


def test_failure_phases_survive_the_schedulers_row() -> None:
    state = new_round()
    state.record_failure(3, "user_code: load_data raised", "load_data")
    row = _state_row(state)
    assert row is not None
    restored = _state_from_row(json.loads(json.dumps(row)))
    assert restored is not None and restored.phases == {3: "load_data"}
    old = _state_from_row({k: v for k, v in row.items() if k != "phases"})  # a row written before phases
    assert old is not None and old.phases == {}


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**63 - 1),
    server_round=st.integers(0, 10_000),
    total=st.integers(1, 500),
    fraction=st.floats(0.0, 1.0),
)
def test_sample_clients_draws_k_distinct_sorted_ids_in_range(
    seed: int, server_round: int, total: int, fraction: float
) -> None:
    k = max(1, int(fraction * total))
    clients = sample_clients(seed, server_round, total, k)
    assert len(clients) == k
    assert clients == sorted(set(clients))
    assert all(type(c) is int and 0 <= c < total for c in clients)


def test_sample_clients_is_the_same_for_the_same_seed_and_round() -> None:
    assert sample_clients(42, 3, 100, 10) == sample_clients(42, 3, 100, 10)


def test_sample_clients_differs_across_rounds() -> None:
    draws = {tuple(sample_clients(42, r, 100, 10)) for r in range(1, 6)}
    assert len(draws) == 5


def test_sample_clients_differs_across_seeds() -> None:
    draws = {tuple(sample_clients(seed, 1, 100, 10)) for seed in range(5)}
    assert len(draws) == 5


@pytest.mark.parametrize("k", [10, 11, 1000])
def test_sample_clients_returns_everyone_when_k_is_at_least_total(k: int) -> None:
    assert sample_clients(42, 3, 10, k) == list(range(10))


def test_a_client_whose_data_cannot_train_is_not_retried_and_a_round_of_only_those_fails_at_once() -> None:
    from fedmq.common.messages import ClientFailure

    def failure(client: int, code: str) -> ClientFailure:
        return ClientFailure(job_id="j", task_id=f"j:4:{client}", round=4, client=client, code=code,
                             reason="x")

    state = new_round(quorum=3, retries=2)
    report(state, 1, 3)
    state.record_client_failure(failure(5, "no_data"))
    state.record_client_failure(failure(7, "error"))  # a crash: another attempt may go through
    assert state.decide(DEADLINE) is Decision.RETRY
    assert state.retry(DEADLINE + 10) == [7]  # 5's failure stays: it would fail the same way
    assert state.failed == {5: "no_data: x"} and state.final == {5}
    restored = _state_from_row(json.loads(json.dumps(_state_row(state))))
    assert restored is not None and restored.final == {5}
    state.record_client_failure(failure(7, "no_data"))
    assert state.decide(BEFORE) is Decision.FAIL  # retries left, but none could help
