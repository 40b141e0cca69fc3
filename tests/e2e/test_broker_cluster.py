"""A job on a three-node RabbitMQ cluster survives losing the node its services are connected to.

Every service lists all three nodes. Each node in turn is stopped (`rabbitmqctl stop_app`)
while the services are connected to it and a round is in flight (its tasks held by learners
whose training waits at a round gate); the job goes on over the other two nodes, and the node
is started again before the next one goes. Messages travel as chunks (64 KiB frames), so the
chunked path runs over every node too. The job must end with exactly the weights of an
undisturbed run.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import canonical_json
from tests.conftest import EmbeddedRuns, assert_bit_identical, small_job
from tests.e2e.cluster import Cluster, services
from tests.e2e.round_gate import TASK, RoundGate
from tests.rabbit_cluster import Node, rabbit_cluster

# It runs RabbitMQ nodes of its own: three Erlang VMs, the suite's costliest test, so it is a soak
# test (`make test-soak`), out of `make test`, which must stay within CI's 20 minutes on 2 cores.
pytestmark = [pytest.mark.rabbitmq, pytest.mark.soak]

LEARNERS = 2
SERVICES = Counter({"scheduler": 1, "aggregator": 1, "learner": LEARNERS})  # connections by name


def reached(c: Cluster, job_id: str, server_round: int) -> Callable[[], bool]:
    return lambda: c.job_round(job_id) >= server_round


def test_a_job_survives_stopping_each_node_it_is_connected_to(
    tmp_path: Path, embedded_runs: EmbeddedRuns
) -> None:
    # Rounds 1..7 go by twos around the three stops; round 8 runs on the healed cluster.
    spec = small_job(rounds=8, round_timeout_s=300, task__name=TASK, task__options__model__hidden=[512])
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(canonical_json(spec))  # JSON is YAML
    gate = RoundGate(tmp_path / "gate", spec)
    gate.allow(1)
    started = time.monotonic()
    stops: list[str] = []
    with rabbit_cluster(tmp_path / "rabbit") as rabbit, services(
        rabbit.broker_url, tmp_path, learners=LEARNERS, FEDMQ_TEST_ROUND_GATE=str(gate.folder),
        FEDMQ_RETRY_INITIAL_S="0.2", FEDMQ_FRAME_BYTES=str(64 * 1024),
    ) as c:
        c.wait_learners(LEARNERS)
        submitted = c.fedmq("submit", str(spec_path))
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        for step, node in enumerate(rabbit.nodes):
            limit = 1 + 2 * step
            assert c.wait_for(reached(c, job_id, limit + 1), timeout=120), (
                f"stuck before round {limit + 1} after stopping {stops}; logs in {tmp_path}"
            )

            def all_on(node: Node = node) -> bool:
                return Counter(rabbit.connected(node)) & SERVICES == SERVICES

            assert c.wait_for(all_on, timeout=60), f"the services are not all on {node.name}"
            rabbit.stop_app(node)  # round limit + 1 is in flight: learners hold its tasks
            stops.append(f"{node.name.split('@')[0]} in round {limit + 1}")
            gate.allow(limit + 2)  # it and one more round run on the other two nodes
            assert c.wait_for(reached(c, job_id, limit + 3), timeout=120), (
                f"no progress without {node.name}; logs in {tmp_path}"
            )
            rabbit.start_app(node)

            def healed() -> bool:
                return not any(rabbit.quorum_critical(n) for n in rabbit.nodes)

            assert c.wait_for(healed, timeout=120), f"quorum queues did not heal after {node.name} came back"
        gate.allow(spec.rounds)
        watched = c.fedmq("watch", job_id, "--json", timeout=300)
        assert watched.returncode == 0, watched.stderr + c.log("aggregator")[-3000:]
        result = json.loads(watched.stdout)
        alive = {name: proc.poll() is None for name, proc in c.procs.items()}
        connects = {name: c.log(name).count('"broker_connected"') for name in c.procs}
    print(f"\nbroker cluster: stopped {', '.join(stops)}; {time.monotonic() - started:.0f} s; "
          f"connections per service {connects}")
    assert all(alive.values()), alive
    assert result["status"] == "completed"
    assert [h["round"] for h in result["history"]] == list(range(spec.rounds + 1))
    assert_bit_identical(load_state(result["model_path"])[0], embedded_runs.weights(spec))
