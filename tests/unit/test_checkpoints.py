"""The aggregator's checkpoints: keyed by weights and strategy state, served by the weights' digest."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fedmq.common import codec
from fedmq.common.allowlist import AllowList
from fedmq.common.checkpoint import save_state
from fedmq.services.aggregator.jobs import AggJob, new_job, restore_job, rewind
from fedmq.services.aggregator.rounds import close_round, initial_round
from fedmq.services.aggregator.store import JobStore
from tests.conftest import small_job

TESTS_ALLOWED = AllowList.services(("tests", "examples"))  # as tests/conftest.py allows

STEADY = small_job(**{"strategy": {"name": "tests.support.strategies:Steady"}, "evaluate__server": False})


def rounds_of_steady(root: Path, rounds: int) -> AggJob:
    """A job of the Steady strategy (same weights, state counting rounds) closed `rounds` times."""
    job = new_job(root, "steady", STEADY, TESTS_ALLOWED)
    initial_round(job, None)
    for r in range(1, rounds + 1):
        close_round(job, r, [], [], None)
    return job


def test_each_round_keeps_its_own_strategy_state_when_the_weights_do_not_change(tmp_path: Path) -> None:
    job = rounds_of_steady(tmp_path, 2)
    keys = job.store.rounds()
    assert len({codec.state_digest(job.store.load_checkpoint(k)[0]) for k in keys.values()}) == 1
    for r, key in keys.items():
        assert int(job.store.load_checkpoint(key)[1]["rounds"]) == r, f"round {r}'s checkpoint"
    job.checkpoint = keys[0]  # back to round 0, as a failed round 1 would be undone
    rewind(job)
    assert int(job.strategy.state()["rounds"]) == 0
    restored = restore_job(tmp_path, "steady", TESTS_ALLOWED)
    assert restored.round == 2 and int(restored.strategy.state()["rounds"]) == 2


def test_the_announced_digest_is_the_weights_and_serves_them(tmp_path: Path) -> None:
    job = rounds_of_steady(tmp_path, 1)
    assert job.digest == codec.state_digest(job.weights) == job.last_closed.model_digest  # type: ignore[union-attr]
    assert codec.state_digest(job.store.load_weights(job.digest)) == job.digest
    assert job.store.find_weights("0" * 64) is None
    assert job.store.find_weights("../" + job.digest) is None, "only a digest names a file"


def test_a_job_stored_in_the_older_layout_resumes_and_serves_its_weights(tmp_path: Path) -> None:
    job = rounds_of_steady(tmp_path, 1)
    store = JobStore(tmp_path, "steady")
    old: dict[int, str] = {}
    for r, key in store.rounds().items():  # rewrite as before: named by the weights' digest alone
        weights, state = store.load_checkpoint(key)
        digest = codec.state_digest(weights)
        tensors = {f"w.{k}": v for k, v in weights.items()} | {f"s.{k}": v for k, v in state.items()}
        store.checkpoint_path(key).unlink()
        save_state(store.checkpoint_path(digest), tensors, {"round": str(r)})
        old[r] = digest
    (store.root / "rounds.json").write_text(json.dumps(old))
    restored = restore_job(tmp_path, "steady", TESTS_ALLOWED)
    assert restored.digest == job.digest and int(restored.strategy.state()["rounds"]) == 1
    assert all(torch.equal(restored.weights[k], job.weights[k]) for k in job.weights)
    assert codec.state_digest(store.load_weights(job.digest)) == job.digest
    close_round(restored, 2, [], [], None)
    assert int(restored.store.load_checkpoint(restored.store.rounds()[2])[1]["rounds"]) == 2
