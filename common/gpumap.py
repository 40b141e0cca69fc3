"""FedML's gpu_mapping.yaml (seed 001) as learner placements: one learner replica per process.

A mapping file holds named mappings; each maps a host to the number of processes per GPU:

    mapping_default:
      host1: [2, 1]     # host1: two processes on GPU 0, one on GPU 1
      host2: [0, 1]     # host2: GPU 0 unused, one process on GPU 1

Each process becomes a learner replica on that host, numbered from 0 in GPU order, bound to its
GPU by CUDA_VISIBLE_DEVICES (so it sees only that GPU, as `cuda:0`, seed 004's isolation) and
FEDMQ_DEVICE=cuda. This replaces the round-robin spread of FEDMQ_DEVICE=cuda over replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from fedmq.common.errors import ConfigError

MAX_FILE_BYTES = 64 * 1024
MAX_PROCESSES = 4096  # per mapping: a typo like 1000000 is refused, not expanded


@dataclass(frozen=True)
class Placement:
    host: str
    replica: int
    gpu: int

    def env(self) -> dict[str, str]:
        """The learner's environment on its host."""
        return {
            "FEDMQ_NODE": self.host, "FEDMQ_REPLICA": str(self.replica),
            "CUDA_VISIBLE_DEVICES": str(self.gpu), "FEDMQ_DEVICE": "cuda",
        }


def read_mapping(text: str, key: str | None = None) -> dict[str, list[int]]:
    """One mapping of a gpu_mapping.yaml: host → processes per GPU; ConfigError saying what is wrong."""
    if len(text.encode()) > MAX_FILE_BYTES:
        raise ConfigError(f"the GPU mapping file is over {MAX_FILE_BYTES // 1024} KiB")
    try:
        data = yaml.safe_load(text.replace("\t", "  "))  # FedML's own example indents with tabs
    except yaml.YAMLError as exc:
        raise ConfigError(f"the GPU mapping file is not YAML: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError("a GPU mapping file maps names to mappings, e.g. mapping_default: {host1: [1, 1]}")
    if key is None:
        if len(data) != 1:
            raise ConfigError(f"the file holds mappings {sorted(map(str, data))}: name one with --key")
        key = next(iter(data))
    if key not in data:
        raise ConfigError(f"no mapping {key!r} in the file; it holds {sorted(map(str, data))}")
    return _checked(key, data[key])


def _checked(key: str, mapping: Any) -> dict[str, list[int]]:
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError(f"mapping {key!r} must map hosts to process counts per GPU, e.g. host1: [2, 1]")
    out: dict[str, list[int]] = {}
    for host, counts in mapping.items():
        if not isinstance(host, str) or not host.strip():
            raise ConfigError(f"mapping {key!r}: host {host!r} must be a name")
        if not isinstance(counts, list) or not counts or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts
        ):
            raise ConfigError(
                f"mapping {key!r}, host {host}: give a list of process counts per GPU (0 or more), "
                f"got {counts!r}"
            )
        out[host] = counts
    total = sum(sum(counts) for counts in out.values())
    if total == 0:
        raise ConfigError(f"mapping {key!r} places no process on any GPU")
    if total > MAX_PROCESSES:
        raise ConfigError(f"mapping {key!r} asks for {total} processes; at most {MAX_PROCESSES}")
    return out


def placements(mapping: dict[str, list[int]]) -> list[Placement]:
    """Every process of the mapping, hosts in file order, replicas from 0 per host in GPU order."""
    out = []
    for host, counts in mapping.items():
        replica = 0
        for gpu, processes in enumerate(counts):
            for _ in range(processes):
                out.append(Placement(host, replica, gpu))
                replica += 1
    return out


def compose_override(placed: list[Placement], base: dict[str, Any]) -> dict[str, Any]:
    """A compose file to add to compose.yaml: one learner service per placement.

    Each is a copy of `base` (compose.yaml's GPU learner service) with its own identity and its
    own GPU reserved by id; inside the container that GPU is the only one, as `cuda:0`.
    """
    import copy

    services: dict[str, Any] = {}
    for p in placed:
        service = copy.deepcopy(base)
        service["profiles"] = ["gpu-mapping"]
        service["environment"] = {
            **(service.get("environment") or {}),
            "FEDMQ_NODE": p.host, "FEDMQ_REPLICA": str(p.replica), "FEDMQ_DEVICE": "cuda",
        }
        service.setdefault("deploy", {})["resources"] = {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": [str(p.gpu)], "capabilities": ["gpu"]},
        ]}}
        service.pop("container_name", None)
        services[f"learner-{_slug(p.host)}-{p.replica}"] = service
    return {"services": services}


def _slug(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in host.lower())
