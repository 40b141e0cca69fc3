"""`fedmq submit` warns, and still submits, when no learner alive can train the job's clients."""

from __future__ import annotations

from fedmq.common.jobspec import parse_job
from fedmq.services.cli.preflight import learners_warning

SITES = parse_job({"name": "s", "task": "digits", "rounds": 1,
                   "clients": {"sites": ["a", "b", "c"], "min_fit": 2}})
LOGICAL = parse_job({"name": "l", "task": "digits", "rounds": 1, "clients": {"total": 5},
                     "round_timeout_s": 60})


def learner(alive: bool = True, sites: tuple[str, ...] = ()) -> dict[str, object]:
    return {"learner": "n/0", "alive": alive, "sites": list(sites)}


def test_no_learner_alive_is_a_warning_saying_how_long_the_job_waits() -> None:
    warning = learners_warning(LOGICAL, [learner(alive=False)])
    assert warning is not None
    assert warning.startswith("no learner is alive: the job's tasks wait in the queue")
    assert "with none it fails after 180 s (round_timeout_s 60 x 3 attempts)" in warning
    assert learners_warning(LOGICAL, [learner(alive=False), learner()]) is None


def test_learners_that_host_sites_only_do_not_count_for_logical_clients() -> None:
    warning = learners_warning(LOGICAL, [learner(sites=("a",))])
    assert warning is not None and warning.startswith("every learner alive hosts sites (FEDMQ_SITES)")


def test_a_sites_job_names_the_sites_no_learner_alive_hosts() -> None:
    assert learners_warning(SITES, [learner(sites=("a", "b")), learner(sites=("c",))]) is None
    warning = learners_warning(SITES, [learner(sites=("b",)), learner(alive=False, sites=("c",)), learner()])
    assert warning is not None and warning.startswith("no learner alive hosts site(s) a, c:")
    assert "fails with fewer than 2 clients left" in warning
