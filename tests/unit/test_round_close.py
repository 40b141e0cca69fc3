"""Closing a round with a user's strategy: what fedmq checks of what the strategy returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedmq.common import codec
from fedmq.common.allowlist import AllowList
from fedmq.common.usercode import UserCodeError
from fedmq.services.aggregator.jobs import new_job, rewind
from fedmq.services.aggregator.rounds import close_round, initial_round
from tests.conftest import small_job

TESTS_ALLOWED = AllowList.services(("tests", "examples"))  # as tests/conftest.py allows


@pytest.mark.parametrize("where", ["weights", "state", "client_state", "shared_state"])
def test_a_strategy_returning_non_finite_values_fails_the_round_as_its_aggregate(
    tmp_path: Path, where: str
) -> None:
    strategy = {"name": "tests.support.strategies:NonFinite", "options": {"where": where}}
    job = new_job(tmp_path, "nan", small_job(strategy=strategy, evaluate__server=False), TESTS_ALLOWED)
    initial_round(job, None)
    with pytest.raises(UserCodeError, match="non-finite") as raised:
        close_round(job, 1, [], [], None)
    assert raised.value.phase == "strategy.aggregate"
    assert job.store.rounds().keys() == {0}, "nothing of round 1 committed"


def test_a_strategy_editing_current_in_place_fails_the_round_and_the_model_is_rewound(tmp_path: Path) -> None:
    strategy = {"name": "tests.support.strategies:Misuses", "options": {"how": "in_place"}}
    job = new_job(tmp_path, "edits", small_job(strategy=strategy, evaluate__server=False), TESTS_ALLOWED)
    initial_round(job, None)
    committed = {k: v.clone() for k, v in job.weights.items()}
    with pytest.raises(UserCodeError, match=r"edited `current` in place \(\S+\): it is the live global"):
        close_round(job, 1, [], [], None)
    rewind(job)  # what the aggregator does after a failed close
    assert all(torch.equal(job.weights[k], committed[k]) for k in committed)
    assert codec.state_digest(job.weights) == job.digest


@pytest.mark.parametrize("how", ["client_state", "shared_state"])
def test_state_for_learners_from_a_strategy_that_does_not_send_it_is_refused(
    tmp_path: Path, how: str
) -> None:
    strategy = {"name": "tests.support.strategies:Misuses", "options": {"how": how}}
    job = new_job(tmp_path, "unsent", small_job(strategy=strategy, evaluate__server=False), TESTS_ALLOWED)
    initial_round(job, None)
    said = rf"returned {how}, but Misuses.sends_client_state is False"
    with pytest.raises(UserCodeError, match=said) as raised:
        close_round(job, 1, [], [], None)
    assert raised.value.phase == "strategy.aggregate" and not job.clients.clients()


def test_the_server_data_is_loaded_by_the_first_evaluation_and_let_go_after_the_last(tmp_path: Path) -> None:
    from fedmq.services.aggregator.evaluation import evaluate_on_server

    job = new_job(tmp_path, "lean", small_job(rounds=2), TESTS_ALLOWED)
    assert job.server_data is None, "nothing loaded before an evaluation asks for it"
    first = evaluate_on_server(job, 0, None)
    assert first is not None and job.server_data is not None
    evaluate_on_server(job, 1, None)
    assert job.server_data is not None, "kept between the job's rounds"
    last = evaluate_on_server(job, 2, None)
    assert last == first, "the same model on the same data"
    assert job.server_data is None and not job.server_data_loaded, "let go after the last round"
    assert evaluate_on_server(job, 2, None) == last, "asked again (a restart's re-close), it loads again"
