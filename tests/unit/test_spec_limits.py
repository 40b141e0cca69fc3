"""Job spec size limits: YAML bombs, deep nesting, huge files and huge options blobs are refused
early with a message naming the bound; real specs pass; the deployment's submission limits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import load_job, parse_job
from fedmq.common.settings import Settings
from fedmq.common.speclimits import (
    MAX_DEPTH,
    MAX_NODES,
    MAX_OPTIONS_BYTES,
    MAX_SPEC_BYTES,
    SpecTooLarge,
    check_yaml_events,
)
from fedmq.services.scheduler.limits import check_submission
from tests.conftest import small_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def laughs(levels: int, width: int = 10) -> str:
    """A "billion laughs" spec: each anchor lists the previous one `width` times (width**levels values)."""
    lines = ["name: bomb", "rounds: 1", "clients: {total: 1}", "task:", "  options:",
             "    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels + 1):
        lines.append(f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


class Counted:
    """An event stream that counts what was read from it."""

    def __init__(self, events: Iterator[yaml.Event]) -> None:
        self.events, self.read = events, 0

    def __iter__(self) -> Iterator[yaml.Event]:
        for event in self.events:
            self.read += 1
            yield event


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_billion_laughs_spec_is_refused_after_reading_a_few_dozen_events(tmp_path: Path) -> None:
    text = laughs(9)  # 10**10 values once expanded, 500 bytes of YAML
    events = Counted(yaml.parse(text, Loader=yaml.SafeLoader))
    with pytest.raises(SpecTooLarge) as info:
        check_yaml_events(iter(events), "bomb.yaml")
    assert info.value.limit == "spec_nodes"
    assert events.read < 100  # refused at the anchor that passes MAX_NODES, nothing built
    with pytest.raises(ConfigError, match=f"more than {MAX_NODES} values once its aliases"):
        load_job(write(tmp_path, text))


def test_a_few_aliases_below_the_bound_count_every_expanded_value() -> None:
    text = laughs(2)  # 10 + 10*11 + 1 + 10*(1+10*11)... counted exactly below
    count = check_yaml_events(yaml.parse(text, Loader=yaml.SafeLoader), "small")
    l0, l1 = 11, 1 + 10 * 11
    l2 = 1 + 10 * l1
    # top mapping, 3 keys + 3 values + {total: 1} (3 nodes), task key, task map, options key, options map
    fixed = 1 + 2 + 2 + 1 + 3 + 1 + 1 + 1 + 1
    assert count == fixed + 3 + l0 + l1 + l2  # + the keys l0, l1, l2


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(SpecTooLarge, match=r"alias \*a refers to itself"):
        check_yaml_events(yaml.parse("a: &a [1, *a]", Loader=yaml.SafeLoader), "rec")


def test_deep_nesting_is_refused_in_yaml_and_in_a_mapping(tmp_path: Path) -> None:
    deep = "name: x\nrounds: 1\nclients: {total: 1}\ntask: {options: {a: " + "[" * 5000 + "]" * 5000 + "}}\n"
    with pytest.raises(ConfigError, match=f"nested more than {MAX_DEPTH} levels"):
        load_job(write(tmp_path, deep))
    nested: dict[str, Any] = {}
    node = nested
    for _ in range(MAX_DEPTH + 1):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(SpecTooLarge, match=f"nested more than {MAX_DEPTH} levels") as info:
        parse_job({"name": "x", "rounds": 1, "clients": {"total": 1}, "task": {"options": nested}})
    assert info.value.limit == "spec_depth"


def test_an_alias_adds_its_anchors_depth_where_it_stands() -> None:
    inner = "[" * 20 + "1" + "]" * 20
    text = f"a: &a {inner}\nb: {'[' * 20}*a{']' * 20}\n"
    with pytest.raises(SpecTooLarge, match="nested more than"):
        check_yaml_events(yaml.parse(text, Loader=yaml.SafeLoader), "deep alias")


def test_a_file_over_the_byte_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    text = "name: big\n#" + "x" * MAX_SPEC_BYTES + "\n"
    with pytest.raises(SpecTooLarge, match=f"more than the {MAX_SPEC_BYTES} a job spec may have") as info:
        load_job(write(tmp_path, text))
    assert info.value.limit == "spec_bytes"


@pytest.mark.parametrize("section", ["task", "train", "strategy"])
def test_a_huge_options_blob_is_refused_naming_its_section(section: str) -> None:
    raw: dict[str, Any] = {"name": "x", "rounds": 1, "clients": {"total": 1},
                           section: {"options": {"blob": "x" * (MAX_OPTIONS_BYTES + 1)}}}
    message = rf"{section}\.options: more than {MAX_OPTIONS_BYTES} bytes"
    with pytest.raises(SpecTooLarge, match=message) as info:
        parse_job(raw)
    assert info.value.limit == "options_bytes"


def test_flat_strategy_options_are_bounded_too() -> None:
    raw = {"name": "x", "rounds": 1, "clients": {"total": 1},
           "strategy": {"name": "fedavg", "blob": ["y" * 1000] * 100}}
    with pytest.raises(SpecTooLarge, match="strategy options: more than"):
        parse_job(raw)


def test_a_mapping_with_too_many_values_is_refused() -> None:
    raw = {"name": "x", "rounds": 1, "clients": {"total": 1}, "task": {"options": {"v": [0] * MAX_NODES}}}
    with pytest.raises(SpecTooLarge, match=f"more than {MAX_NODES} values"):
        parse_job(raw)


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_shipped_example_is_well_within_the_bounds(example: str) -> None:
    text = (EXAMPLES / example).read_text()
    assert check_yaml_events(yaml.parse(text, Loader=yaml.SafeLoader), example) < MAX_NODES // 20


# --- the deployment's limits --------------------------------------------------------------


def test_a_job_within_the_deployment_limits_passes() -> None:
    assert check_submission(small_job(), Settings(), running=0) is None


@pytest.mark.parametrize(("changes", "settings", "running", "limit", "setting"), [
    ({"clients__total": 50}, {"max_clients": 10}, 0, "max_clients", "FEDMQ_MAX_CLIENTS"),
    ({"rounds": 20}, {"max_rounds": 5}, 0, "max_rounds", "FEDMQ_MAX_ROUNDS"),
    ({}, {"max_jobs": 2}, 2, "max_jobs", "FEDMQ_MAX_JOBS=2"),
])
def test_each_deployment_limit_is_refused_naming_its_setting(
    changes: dict[str, Any], settings: dict[str, Any], running: int, limit: str, setting: str
) -> None:
    refusal = check_submission(small_job(**changes), Settings(**settings), running)
    assert refusal is not None
    assert refusal.limit == limit and setting in refusal.message
