"""FedML gpu_mapping.yaml (seed 001) → learner placements, shell lines and compose services."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedmq.common.errors import ConfigError
from fedmq.common.gpumap import Placement, compose_override, placements, read_mapping
from fedmq.services.cli.main import app
from tests.conftest import REPO
from tests.unit.test_deploy import _tool

# FedML's own example indents with tabs; two named mappings, as its --gpu_mapping_key picks from.
MAPPING = "mapping_default:\n\thost1: [2, 1]\n\thost2: [0, 1]\nmapping_small:\n  host1: [1]\n"


def test_each_process_is_a_replica_on_its_host_bound_to_its_gpu() -> None:
    placed = placements(read_mapping(MAPPING, "mapping_default"))
    assert placed == [Placement("host1", 0, 0), Placement("host1", 1, 0), Placement("host1", 2, 1),
                      Placement("host2", 0, 1)]
    assert placed[2].env() == {"FEDMQ_NODE": "host1", "FEDMQ_REPLICA": "2", "CUDA_VISIBLE_DEVICES": "1",
                               "FEDMQ_DEVICE": "cuda"}
    assert placements(read_mapping("m: {solo: [1]}")) == [Placement("solo", 0, 0)]  # one mapping: no key


@pytest.mark.parametrize(("text", "key", "says"), [
    (MAPPING, None, "name one with --key"),
    (MAPPING, "nope", "no mapping 'nope'"),
    ("m: {h: [1, -1]}", None, "process counts per GPU"),
    ("m: {h: 2}", None, "process counts per GPU"),
    ("m: {h: [0, 0]}", None, "places no process"),
    ("m: {h: [100000]}", None, "at most 4096"),
    ("m: [1, 2]", None, "map hosts"),
    ("[", None, "not YAML"),
])
def test_a_bad_mapping_says_what_is_wrong(text: str, key: str | None, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        read_mapping(text, key)


def test_the_command_prints_one_learner_per_line_or_json(tmp_path: Path) -> None:
    (tmp_path / "gpu_mapping.yaml").write_text(MAPPING)
    runner = CliRunner()
    lines = runner.invoke(app, ["gpu-mapping", str(tmp_path / "gpu_mapping.yaml"), "--key", "mapping_default",
                                "--host", "host1"])
    assert lines.exit_code == 0, lines.output
    assert lines.output.splitlines()[2].startswith(
        "FEDMQ_NODE=host1 FEDMQ_REPLICA=2 CUDA_VISIBLE_DEVICES=1 FEDMQ_DEVICE=cuda fedmq learner")
    rows = json.loads(runner.invoke(app, ["gpu-mapping", str(tmp_path / "gpu_mapping.yaml"), "--key",
                                          "mapping_small", "--format", "json"]).output)
    assert [(r["host"], r["replica"], r["gpu"]) for r in rows] == [("host1", 0, 0)]
    refused = runner.invoke(app, ["gpu-mapping", str(tmp_path / "gpu_mapping.yaml")])
    assert refused.exit_code == 2 and "--key" in refused.output


def test_the_compose_services_each_reserve_their_own_gpu(tmp_path: Path) -> None:
    """The services merge with compose.yaml (`docker-compose config`), each with one GPU by id."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    override = compose_override(placements(read_mapping(MAPPING, "mapping_default")),
                                compose["services"]["learner-gpu0"])
    (tmp_path / "override.yaml").write_text(yaml.safe_dump(override))
    env = tmp_path / "compose.env"
    env.write_text((REPO / "deploy" / "compose.env.example").read_text())
    merged = subprocess.run(
        [_tool("docker-compose", "docker-compose"), "--env-file", str(env), "-f", str(REPO / "compose.yaml"),
         "-f", str(tmp_path / "override.yaml"), "--profile", "gpu-mapping", "config"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert merged.returncode == 0, merged.stderr
    services = yaml.safe_load(merged.stdout)["services"]
    got = {name: (s["environment"]["FEDMQ_NODE"], s["environment"]["FEDMQ_REPLICA"],
                  s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"])
           for name, s in services.items() if name.startswith("learner-host")}
    assert got == {"learner-host1-0": ("host1", "0", ["0"]), "learner-host1-1": ("host1", "1", ["0"]),
                   "learner-host1-2": ("host1", "2", ["1"]), "learner-host2-0": ("host2", "0", ["1"])}
