"""Shared fixtures: small job specs and isolated service settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedmq.common.jobspec import JobSpec, parse_job
from fedmq.common.settings import Settings

REPO = Path(__file__).resolve().parent.parent


def small_job(**changes: Any) -> JobSpec:
    """A digits job that trains in about a second: 5 clients, 3 rounds, 1 local epoch."""
    raw: dict[str, Any] = {
        "name": "tiny",
        "seed": 3,
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"name": "digits", "partition": {"kind": "dirichlet", "alpha": 0.5}},
        "clients": {"total": 5},
        "rounds": 3,
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.1},
        "round_timeout_s": 60,
    }
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return parse_job(raw)


def assert_bit_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same names, dtypes, shapes and bytes: equality that NaN or -0.0 cannot fool."""
    import torch

    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(state_dir=tmp_path / "state", log_format="json", log_level="warning")
