"""The learner registry (liveness from heartbeats on the receiver's clock) and seed 003's ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedmq.common.errors import ConfigError
from fedmq.common.messages import Heartbeat
from fedmq.services.scheduler.registry import LearnerInfo, Ranks, Registry, assign_ranks, ddp_env
from tests.conftest import REPO

INTERVAL = 5.0  # every heartbeat here announces this interval, so death comes after 15 s of silence
T0 = 1000.0


def beat(
    node: str, replica: int, *, busy: bool = False, device: str = "cpu", sent_at: float = 0.0
) -> Heartbeat:
    return Heartbeat(
        learner=f"{node}/{replica}",
        node=node,
        replica=replica,
        device=device,
        busy=busy,
        pid=100 + replica,
        interval_s=INTERVAL,
        sent_at=sent_at,
    )


def table(rows: list[LearnerInfo]) -> list[tuple[str, int | None, int | None, int | None, int]]:
    return [(r.learner, r.rank, r.local_rank, r.node_rank, r.world_size) for r in rows]


def registry_with(*members: tuple[str, int], master_node: str = "", now: float = T0) -> Registry:
    registry = Registry(master_node=master_node)
    for node, replica in members:
        registry.heartbeat(beat(node, replica), now)
    return registry


# --- membership and liveness -----------------------------------------------------------------


def test_a_learner_appears_on_its_first_heartbeat() -> None:
    registry = Registry()
    assert registry.heartbeat(beat("gn6", 0, device="cuda:0"), T0) is True
    [info] = registry.alive()
    assert (info.learner, info.node, info.replica) == ("gn6/0", "gn6", 0)
    assert (info.device, info.pid) == ("cuda:0", 100)
    assert info.alive and info.last_seen == T0
    assert registry.alive_count == 1


def test_repeated_heartbeats_update_busy_device_and_last_seen_without_a_membership_change() -> None:
    registry = registry_with(("gn6", 0))
    assert registry.heartbeat(beat("gn6", 0, busy=True, device="cuda:1"), T0 + 4) is False
    [info] = registry.alive()
    assert (info.busy, info.device, info.last_seen) == (True, "cuda:1", T0 + 4)
    assert registry.busy_count == 1
    assert registry.heartbeat(beat("gn6", 0, busy=False), T0 + 8) is False
    assert registry.busy_count == 0


def test_liveness_uses_the_receivers_clock_not_the_senders_sent_at() -> None:
    registry = Registry()
    registry.heartbeat(beat("gn6", 0, sent_at=T0 + 10_000), T0)  # a sender whose clock runs far ahead
    assert registry.sweep(T0 + 3 * INTERVAL + 0.1) == ["gn6/0"]


def test_a_late_heartbeat_never_moves_last_seen_back() -> None:
    registry = registry_with(("gn6", 0), now=T0 + 10)
    registry.heartbeat(beat("gn6", 0), T0 + 5)
    assert registry.alive()[0].last_seen == T0 + 10


def test_a_learner_silent_for_exactly_three_intervals_is_still_alive() -> None:
    registry = registry_with(("gn6", 0))
    assert registry.sweep(T0 + 3 * INTERVAL) == []
    assert registry.alive_count == 1


def test_silence_beyond_three_intervals_marks_a_learner_dead_exactly_once() -> None:
    registry = registry_with(("gn6", 0), ("gn7", 0))
    registry.heartbeat(beat("gn7", 0), T0 + 10)
    assert registry.sweep(T0 + 3 * INTERVAL + 0.1) == ["gn6/0"]
    assert registry.sweep(T0 + 3 * INTERVAL + 5) == []
    assert [i.learner for i in registry.alive()] == ["gn7/0"]
    assert registry.alive_count == 1


def test_a_heartbeat_after_death_revives_the_learner_and_reports_a_membership_change() -> None:
    registry = registry_with(("gn6", 0))
    assert registry.sweep(T0 + 100) == ["gn6/0"]
    assert registry.heartbeat(beat("gn6", 0), T0 + 101) is True
    assert registry.alive_count == 1
    assert registry.sweep(T0 + 102) == []


def test_a_learner_that_moves_to_another_replica_id_is_a_membership_change() -> None:
    registry = registry_with(("gn6", 0))
    moved = beat("gn6", 0).model_copy(update={"replica": 3})
    assert registry.heartbeat(moved, T0 + 1) is True
    assert registry.alive()[0].replica == 3


def test_a_dead_learner_is_not_counted_busy() -> None:
    registry = Registry()
    registry.heartbeat(beat("gn6", 0, busy=True), T0)
    registry.sweep(T0 + 100)
    assert registry.busy_count == 0


def test_forget_drops_a_learner_and_a_later_heartbeat_makes_it_new_again() -> None:
    registry = registry_with(("gn6", 0), ("gn6", 1))
    registry.forget("gn6/0")
    registry.forget("nobody/9")
    assert [i.learner for i in registry.snapshot(T0)] == ["gn6/1"]
    assert registry.heartbeat(beat("gn6", 0), T0 + 1) is True


def test_snapshot_lists_the_alive_by_rank_then_the_dead_without_ranks() -> None:
    registry = registry_with(("gn7", 0), ("gn6", 1), ("gn6", 0), master_node="gn6")
    registry.heartbeat(beat("gn6", 0), T0 + 20)
    registry.heartbeat(beat("gn7", 0), T0 + 20)
    assert registry.sweep(T0 + 20) == ["gn6/1"]
    assert table(registry.snapshot(T0 + 20)) == [
        ("gn6/0", 0, 0, 0, 2),
        ("gn7/0", 1, 0, 1, 2),
        ("gn6/1", None, None, None, 2),
    ]
    assert [r.alive for r in registry.snapshot(T0 + 20)] == [True, True, False]


def test_snapshot_shows_an_overdue_learner_dead_before_the_sweep_without_recording_it() -> None:
    registry = registry_with(("gn6", 0), ("gn7", 0))
    registry.heartbeat(beat("gn7", 0), T0 + 20)
    assert table(registry.snapshot(T0 + 20)) == [("gn7/0", 0, 0, 0, 1), ("gn6/0", None, None, None, 1)]
    assert registry.alive_count == 2
    assert registry.sweep(T0 + 20) == ["gn6/0"]


def test_as_dict_is_a_json_row_with_the_age_on_the_receivers_clock() -> None:
    registry = registry_with(("gn6", 0))
    [info] = registry.snapshot(T0 + 2.04)
    assert info.as_dict(T0 + 2.04) == {
        "learner": "gn6/0",
        "node": "gn6",
        "replica": 0,
        "device": "cpu",
        "busy": False,
        "pid": 100,
        "alive": True,
        "rank": 0,
        "local_rank": 0,
        "node_rank": 0,
        "world_size": 1,
        "sites": [],
        "group": "",
        "age_s": 2.0,
    }


def test_a_nonpositive_death_threshold_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Registry(dead_after_intervals=0)


# --- ranks (seed 003) ------------------------------------------------------------------------


def test_a_configured_master_node_comes_first_even_when_it_sorts_last() -> None:
    registry = registry_with(("gn7", 1), ("gn7", 0), ("gn39", 1), ("gn39", 0), master_node="gn7")
    assert table(registry.alive()) == [
        ("gn7/0", 0, 0, 0, 4),
        ("gn7/1", 1, 1, 0, 4),
        ("gn39/0", 2, 0, 1, 4),
        ("gn39/1", 3, 1, 1, 4),
    ]


def test_without_a_configured_master_the_first_node_by_name_is_master() -> None:
    registry = registry_with(("gn7", 0), ("gn39", 0))
    assert table(registry.alive()) == [("gn39/0", 0, 0, 0, 2), ("gn7/0", 1, 0, 1, 2)]


def test_a_configured_master_that_has_no_learners_falls_back_to_the_first_node_by_name() -> None:
    ranks = assign_ranks([("b/0", "b", 0), ("a/0", "a", 0)], master_node="gone")
    assert ranks["a/0"].node_rank == 0 and ranks["b/0"].node_rank == 1


def test_seed_003s_four_node_example_sorts_node_names_as_strings_after_the_master() -> None:
    members = [(f"{n}-0", n, 0) for n in ("gn7", "gn40", "gn6", "gn39")]
    ranks = assign_ranks(members, master_node="gn6")
    assert [(name, r.rank, r.node_rank) for name, r in sorted(ranks.items(), key=lambda kv: kv[1].rank)] == [
        ("gn6-0", 0, 0),
        ("gn39-0", 1, 1),
        ("gn40-0", 2, 2),
        ("gn7-0", 3, 3),
    ]


def test_replicas_2_and_10_sort_numerically() -> None:
    registry = registry_with(("gn6", 10), ("gn6", 2))
    assert [(i.replica, i.local_rank) for i in registry.alive()] == [(2, 0), (10, 1)]


def test_equal_replica_ids_on_one_node_tie_break_by_learner_name() -> None:
    ranks = assign_ranks([("gn6/b", "gn6", 0), ("gn6/a", "gn6", 0)])
    assert (ranks["gn6/a"].local_rank, ranks["gn6/b"].local_rank) == (0, 1)


def test_local_ranks_restart_at_zero_on_each_node() -> None:
    registry = registry_with(("a", 0), ("a", 1), ("a", 2), ("b", 5), ("b", 7))
    assert [(i.node, i.local_rank, i.rank) for i in registry.alive()] == [
        ("a", 0, 0),
        ("a", 1, 1),
        ("a", 2, 2),
        ("b", 0, 3),
        ("b", 1, 4),
    ]


def test_world_size_counts_only_alive_learners() -> None:
    registry = registry_with(("gn6", 0), ("gn6", 1), ("gn7", 0))
    registry.heartbeat(beat("gn6", 0), T0 + 20)
    registry.sweep(T0 + 20)
    assert {i.world_size for i in registry.snapshot(T0 + 20)} == {1}
    assert table(registry.alive()) == [("gn6/0", 0, 0, 0, 1)]


def test_a_dead_learners_ranks_are_reassigned_without_gaps() -> None:
    registry = registry_with(("gn6", 0), ("gn6", 1), ("gn7", 0), ("gn7", 1), master_node="gn6")
    for node, replica in [("gn6", 0), ("gn7", 0), ("gn7", 1)]:
        registry.heartbeat(beat(node, replica), T0 + 20)
    assert registry.sweep(T0 + 20) == ["gn6/1"]
    assert table(registry.alive()) == [("gn6/0", 0, 0, 0, 3), ("gn7/0", 1, 0, 1, 3), ("gn7/1", 2, 1, 1, 3)]


def test_when_the_whole_master_node_dies_the_next_node_by_name_takes_node_rank_0() -> None:
    registry = registry_with(("gn7", 0), ("gn39", 0), ("gn40", 0), master_node="gn7")
    for node in ("gn39", "gn40"):
        registry.heartbeat(beat(node, 0), T0 + 20)
    registry.sweep(T0 + 20)
    assert table(registry.alive()) == [("gn39/0", 0, 0, 0, 2), ("gn40/0", 1, 0, 1, 2)]


def test_no_members_get_no_ranks_and_duplicate_names_are_refused() -> None:
    assert assign_ranks([]) == {}
    with pytest.raises(ValueError):
        assign_ranks([("x", "a", 0), ("x", "b", 0)])


# --- ddp environment ---------------------------------------------------------------------------


def test_ddp_env_gives_torch_distributed_its_six_variables_as_strings() -> None:
    env = ddp_env(Ranks(rank=3, local_rank=1, node_rank=1, world_size=4), "gn6", 29500)
    assert env == {
        "MASTER_ADDR": "gn6",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "4",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "NODE_RANK": "1",
    }


@pytest.mark.parametrize(("addr", "port"), [("", 29500), ("gn6", 0), ("gn6", 65536)])
def test_ddp_env_refuses_an_empty_master_address_or_a_port_out_of_range(addr: str, port: int) -> None:
    with pytest.raises(ConfigError):
        ddp_env(Ranks(0, 0, 0, 1), addr, port)


# --- control plane stays torch-free ------------------------------------------------------------


def test_importing_the_registry_does_not_import_torch() -> None:
    code = "import sys, fedmq.services.scheduler.registry; sys.exit('torch' in sys.modules)"
    run = [sys.executable, "-c", code]
    result = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr or "torch was imported"


def test_importing_the_scheduler_process_wiring_does_not_import_torch() -> None:
    code = "import sys, fedmq.services.scheduler.app; sys.exit('torch' in sys.modules)"
    run = [sys.executable, "-c", code]
    result = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr or "torch was imported"
