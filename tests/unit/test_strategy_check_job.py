"""Strategy.check_job: settings a strategy cannot run with are refused before the job is published."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import fedmq
from fedmq.common.allowlist import AllowList
from fedmq.common.errors import ConfigError
from fedmq.common.jobcheck import complete_spec
from fedmq.services.aggregator.jobs import new_job
from tests.conftest import small_job

TESTS_ALLOWED = AllowList.services(("tests", "examples"))  # as tests/conftest.py allows


def job(strategy: dict[str, Any], **changes: Any) -> Any:
    """Ten clients, all of them every round and all needed unless `changes` say otherwise."""
    return small_job(**{"clients__total": 10, "strategy": strategy, **changes})


@pytest.mark.parametrize(
    ("strategy", "changes", "said"),
    [
        ({"name": "krum", "options": {"f": 5}}, {},
         r"krum with f=5 .* needs 13 clients a round; the job samples 10"),
        ({"name": "bulyan", "options": {"f": 3}}, {}, r"bulyan with f=3 .* needs 15 clients"),
        ({"name": "multi_krum", "options": {"f": 1, "m": 50}}, {},
         r"multi_krum averaging m=50 updates needs 50"),
        ({"name": "krum", "options": {"f": 3}}, {"clients__min_fit": 8},
         r"clients.min_fit=8: set clients.min_fit >= 9"),
        ({"name": "multi_krum", "options": {"f": 3}}, {"clients__min_fit": 8}, r"multi_krum with f=3"),
        ({"name": "trimmed_mean", "options": {"beta": 0.1}}, {"clients__min_fit": 5},
         r"trims nothing from a round of clients.min_fit=5"),
        ({"name": "scaffold"}, {"train__optimizer": "adam"},
         r"needs plain SGD steps; this job trains with adam"),
        ({"name": "scaffold"}, {"train__momentum": 0.9}, r"\(momentum 0.9\): set train.optimizer: sgd"),
        ({"name": "clipped", "options": {"inner": {"name": "bulyan", "options": {"f": 2}}}}, {},
         r"bulyan with f=2"),
    ],
)
def test_settings_that_would_fail_after_round_1_are_refused_before_publishing(
    strategy: dict[str, Any], changes: dict[str, Any], said: str
) -> None:
    spec = job(strategy, **changes)
    with pytest.raises(ConfigError, match=rf"strategy '\w+' cannot run this job: .*{said}"):
        complete_spec(spec)


@pytest.mark.parametrize(
    "strategy",
    [
        {"name": "krum", "options": {"f": 3}},
        {"name": "multi_krum", "options": {"f": 3, "m": 10}},
        {"name": "bulyan", "options": {"f": 1}},
        {"name": "trimmed_mean", "options": {"beta": 0.1}},
        {"name": "trimmed_mean", "options": {"beta": 0.0}},
        {"name": "scaffold"},
        {"name": "clipped", "options": {"inner": {"name": "krum", "options": {"f": 3}}}},
    ],
)
def test_settings_at_the_limit_pass(strategy: dict[str, Any]) -> None:
    complete_spec(job(strategy))


def test_the_aggregator_refuses_a_job_published_without_the_check(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="krum with f=5"):
        new_job(tmp_path, "j", job({"name": "krum", "options": {"f": 5}}), TESTS_ALLOWED)


class Picky(fedmq.Strategy):
    """A user's strategy checking the job: needs three clients a round; its own check has a bug when asked
    about one client."""

    @classmethod
    def check_job(cls, options: fedmq.StrategyOptions, job: fedmq.JobFacts) -> None:
        if job.clients_total == 1:
            raise ZeroDivisionError("the user's bug")
        if job.min_fit < 3:
            raise ValueError(f"needs rounds of 3 clients or more; set clients.min_fit >= 3 ({job.min_fit})")

    def aggregate(self, ctx: Any, current: Any, results: Any, failures: Any) -> fedmq.Aggregate:
        return fedmq.Aggregate(dict(current))


def test_a_users_strategy_refuses_with_its_own_words_and_a_bug_in_its_check_says_so() -> None:
    name = "tests.unit.test_strategy_check_job:Picky"
    complete_spec(small_job(strategy={"name": name}, clients={"total": 3}))
    with pytest.raises(ConfigError, match="cannot run this job: needs rounds of 3 clients or more"):
        complete_spec(small_job(strategy={"name": name}, clients={"total": 5, "min_fit": 2}))
    with pytest.raises(ConfigError, match="check_job raised ZeroDivisionError: the user's bug"):
        complete_spec(small_job(strategy={"name": name}, clients={"total": 1}))
