"""Test tiers, as the markers say:

    rabbitmq  needs a real broker: marked where the test is (a module's `pytestmark`, a decorator,
              the `transport` fixture's RabbitMQ parameter); a test that reaches the broker
              without the marker fails (tests/rabbit.py), so a missing marker cannot go unnoticed
    slow      everything under tests/e2e (real processes), plus what is marked by hand: fuzzers, and
              in-memory runs of several seconds that keep `make test-fast` under 2 minutes

`make test-fast` runs `pytest -m "not rabbitmq and not slow"`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e"


def mark_tiers(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e is slow."""
    for item in items:
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.slow)
