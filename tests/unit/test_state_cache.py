"""A learner's own copy of its clients' state (services/learner/statecache.py): served only for
the version asked, bounded in memory, spilled to disk (sealed where the learner seals), evicted."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from fedmq.common.codec.compress import encoded_nbytes
from fedmq.common.codec.updates import RESIDUAL, STATE
from fedmq.common.messages import TrainTask
from fedmq.common.metrics import Metrics
from fedmq.common.settings import Settings
from fedmq.common.strategy.contract import CLIENT_STATE, LEARNER_STATE
from fedmq.common.task.runtime import TaskRuntime
from fedmq.common.task.sealing import StateSealer
from fedmq.services.learner.statecache import StateCache
from fedmq.services.learner.work import Work
from tests.conftest import small_job

KEY = "a learner's key, long enough"


def made(client: int, size: int = 256) -> dict[str, torch.Tensor]:
    """A client's state as a learner makes it: a Task's entry, topk's residual, and one not fedmq's."""
    g = torch.Generator().manual_seed(client)
    return {
        f"{STATE}t.optimizer.momentum.w": torch.randn(size, generator=g),
        f"{RESIDUAL}w": torch.randn(size // 4, generator=g),
        "user.extra": torch.zeros(3),
    }


def cache(
    tmp_path: Path, memory: int, disk: int, sealer: StateSealer | None = None
) -> tuple[StateCache, Counter[str]]:
    events: Counter[str] = Counter()

    def count(event: str) -> None:
        events[event] += 1

    return StateCache(tmp_path / "kept", memory, disk, sealer, count), events


def kept_part(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith("fedmq.")}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_only_the_training_asked_for_is_served_and_only_fedmqs_entries_are_kept(tmp_path: Path) -> None:
    kept, events = cache(tmp_path, 1 << 20, 1 << 20)
    kept.put("job", 3, "first", made(3))
    kept.put("job", 3, "again", made(3))  # trained again (a nudge's copy): the one folded was "first"
    assert kept.get("job", 3, "first") is None
    assert kept.get("job", 4, "again") is None and kept.get("other", 3, "again") is None
    assert kept.get("job", 3, "") is None  # an update announced without a tag matches nothing
    assert_same(kept.get("job", 3, "again") or {}, kept_part(made(3)))
    assert events == {"hit": 1}


def test_a_served_state_is_a_copy_training_may_change(tmp_path: Path) -> None:
    kept, _ = cache(tmp_path, 1 << 20, 1 << 20)
    kept.put("job", 0, "t0", made(0))
    first = kept.get("job", 0, "t0")
    assert first is not None
    for tensor in first.values():
        tensor.add_(1.0)  # an optimizer's buffers move in place; the task may then fail and come again
    assert_same(kept.get("job", 0, "t0") or {}, kept_part(made(0)))


def test_over_memory_the_least_recently_used_spill_and_come_back_bit_for_bit(tmp_path: Path) -> None:
    one = encoded_nbytes(kept_part(made(0)))
    kept, events = cache(tmp_path, memory=2 * one, disk=10 * one)
    for client in range(4):
        kept.put("job", client, f"t{client}", made(client))
    assert kept.memory_used == 2 * one and kept.disk_used == 2 * one
    assert len(list((tmp_path / "kept").glob("*.state"))) == 2
    for client in range(4):
        assert_same(kept.get("job", client, f"t{client}") or {}, kept_part(made(client)))
    assert events["spilled"] == 2 and events["hit"] == 4


def test_spilled_task_state_is_sealed_on_disk_and_a_tampered_file_is_fetched_instead(tmp_path: Path) -> None:
    one = encoded_nbytes(kept_part(made(0)))
    kept, events = cache(tmp_path, memory=one, disk=10 * one, sealer=StateSealer(KEY))
    kept.put("job", 0, "t0", made(0))
    kept.put("job", 1, "t1", made(1))  # client 0 goes to disk
    (spilled,) = (tmp_path / "kept").glob("*.state")
    raw = spilled.read_bytes()
    clear = made(0)[f"{STATE}t.optimizer.momentum.w"].numpy().tobytes()
    assert clear[:64] not in raw, "a Task's state is never on disk in the clear"
    assert_same(kept.get("job", 0, "t0") or {}, kept_part(made(0)))

    data = bytearray(spilled.read_bytes())
    data[-20] ^= 0xFF
    spilled.write_bytes(bytes(data))
    assert kept.get("job", 0, "t0") is None, "a file changed on disk is refused: the durable copy is fetched"
    assert not spilled.exists() and events["hit"] == 1
    assert_same(kept.get("job", 1, "t1") or {}, kept_part(made(1)))


def test_over_disk_the_oldest_go_and_a_state_larger_than_both_is_not_kept(tmp_path: Path) -> None:
    one = encoded_nbytes(kept_part(made(0)))
    kept, events = cache(tmp_path, memory=one, disk=one)
    for client in range(3):
        kept.put("job", client, f"t{client}", made(client))
    assert kept.get("job", 0, "t0") is None  # evicted: fetched from the aggregator
    assert kept.get("job", 1, "t1") is not None and kept.get("job", 2, "t2") is not None
    assert events["evicted"] >= 1
    kept.put("job", 9, "t9", made(9, size=4096))
    assert kept.get("job", 9, "t9") is None and events["too_large"] == 1


def test_a_new_process_never_trusts_files_an_earlier_one_spilled(tmp_path: Path) -> None:
    one = encoded_nbytes(kept_part(made(0)))
    kept, _ = cache(tmp_path, memory=0, disk=10 * one)
    kept.put("job", 0, "t0", made(0))
    assert list((tmp_path / "kept").glob("*.state"))
    again, _ = cache(tmp_path, memory=0, disk=10 * one)
    assert not list((tmp_path / "kept").glob("*.state*"))
    assert again.get("job", 0, "t0") is None


@pytest.mark.parametrize("sealer", [None, StateSealer(KEY)], ids=["clear", "sealed"])
def test_close_forgets_everything(tmp_path: Path, sealer: StateSealer | None) -> None:
    one = encoded_nbytes(kept_part(made(0)))
    kept, _ = cache(tmp_path, memory=one, disk=10 * one, sealer=sealer)
    for client in range(3):
        kept.put("job", client, f"t{client}", made(client))
    kept.close()
    assert len(kept) == 0 and kept.memory_used == 0 and kept.disk_used == 0
    assert not list((tmp_path / "kept").glob("*.state"))


@pytest.mark.parametrize("sealer", [None, StateSealer(KEY)], ids=["clear", "sealed"])
def test_an_older_spilled_file_put_back_in_place_is_not_served_as_the_newer(
    tmp_path: Path, sealer: StateSealer | None
) -> None:
    kept, _ = cache(tmp_path, memory=0, disk=1 << 20, sealer=sealer)  # everything spills at once
    kept.put("job", 0, "round-1", made(0))
    (path,) = (tmp_path / "kept").glob("*.state")
    older = path.read_bytes()
    kept.put("job", 0, "round-2", made(1))
    path.write_bytes(older)
    assert kept.get("job", 0, "round-2") is None


def test_a_learner_uses_its_copy_only_for_the_training_the_task_names(tmp_path: Path) -> None:
    """Work.train: round 1 fetches nothing; a task naming this learner's last training uses its copy;
    once the client is trained again (a nudge's copy), the first tag no longer matches: fetched."""
    spec = small_job(train__momentum=0.9, train__keep_optimizer_state=True)
    start = TaskRuntime.for_job(spec).build_model().state_dict()
    fetched: list[tuple[int, int]] = []

    def fetch_state(job_id: str, server_round: int, client: int) -> dict[str, torch.Tensor]:
        fetched.append((server_round, client))
        return {}

    metrics = Metrics()
    work = Work(Settings(state_dir=tmp_path), "learner-0", lambda job, digest, downlink: (dict(start), 0),
                metrics, fetch_state)

    def task(server_round: int, state_from: int, tag: str = "") -> TrainTask:
        return TrainTask(job_id="j", task_id=f"j:{server_round}:0", round=server_round, client=0,
                         model_digest="d", spec=spec.model_dump(mode="json"),
                         config={CLIENT_STATE: LEARNER_STATE}, state_from=state_from, state_tag=tag)

    first = work.train(task(1, 0))
    assert fetched == [] and first.state_tag, "round 1: no state anywhere, nothing fetched"
    second = work.train(task(2, 1, first.state_tag))
    assert fetched == [], "its own copy of the folded training"
    again = work.train(task(2, 1, first.state_tag))  # a nudge's copy of round 2, here too
    assert fetched == [(2, 0)], "its copy is now round 2's: round 1's version is fetched"
    assert again.state_tag not in ("", second.state_tag)
    work.train(task(3, 2, second.state_tag))  # the aggregator folded the first round-2 update
    assert fetched == [(2, 0), (3, 0)], "the copy kept is the other training's: fetched"
    events = {e: metrics.registry.get_sample_value("fedmq_learner_state_cache_total", {"event": e})
              for e in ("hit", "miss")}
    assert events == {"hit": 1.0, "miss": 2.0}
