"""The Python API on a real cluster: the same call as in process, the same weights, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_bit_identical
from tests.e2e.cluster import cluster

pytestmark = pytest.mark.rabbitmq


def test_seed_002_workers_give_the_same_weights_in_process_and_on_rabbitmq(
    tmp_path: Path, monkeypatch
) -> None:
    from examples import seed002_worker

    monkeypatch.chdir(tmp_path)
    embedded = seed002_worker.main()
    (tmp_path / "cluster").mkdir()
    with cluster(tmp_path / "cluster", learners=2) as c:
        c.wait_learners(2)
        on_rabbitmq = seed002_worker.main(broker=c.url)
        final = dict(on_rabbitmq.weights("final"))  # fetched from the aggregator over the broker
    assert embedded.ok and on_rabbitmq.ok
    assert on_rabbitmq.final is not None and (on_rabbitmq.final.get("server.accuracy") or 0) >= 0.92
    assert_bit_identical(final, dict(embedded.weights("final")))
