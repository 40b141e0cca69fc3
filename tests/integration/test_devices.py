"""Training on a GPU: a learner trains where it says it does, and CUDA agrees with the CPU.

Every other test trains on the CPU (tests/conftest.py). These run each case on the CPU here and
on CUDA too where torch sees a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fedmq.common.bus import topology
from fedmq.common.checkpoint import load_state
from fedmq.common.messages import JobSubmit, StatusReply, StatusRequest, expect, from_wire, to_wire
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import EmbeddedCluster, run_job
from fedmq.services.cli.follow import JobFollower
from tests.conftest import EmbeddedRuns, small_job
from tests.integration import train_plugins

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]

# CUDA adds in another order than the CPU, so the same job agrees within float error, not bit for
# bit. Measured here on this test's job (CPU, 3 rounds of SGD): the float32 run and the same run
# in float64 differ by at most 6e-8, the size of what another rounding order does to it; TF32
# matmuls (emulated: inputs rounded to 10 mantissa bits) move it by 4.9e-4, so the test asks
# for IEEE float32 on the GPU. The tolerance leaves >1000x room over rounding and still fails a
# job that trained on other data or in another order (1e-2 and up).
RTOL, ATOL = 1e-3, 1e-4


@contextmanager
def ieee_float32() -> Iterator[None]:
    """No TF32 on a GPU meanwhile: torch's default for matmuls, not for cuDNN's convolutions."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.parametrize("device", DEVICES)
def test_a_learner_trains_on_the_device_it_reports(tmp_path: Path, device: str) -> None:
    spec = small_job(rounds=1, task__name="tests.integration.train_plugins:Recording")
    settings = Settings(state_dir=tmp_path, device=device, log_format="json")
    try:
        with EmbeddedCluster(settings) as cluster:
            follower = JobFollower(cluster.connect(), "devices").start()
            submit = JobSubmit(job_id="devices", spec=spec.model_dump(mode="json"))
            follower.bus.publish(topology.SCHEDULER, to_wire(submit))
            kinds = [event.kind for event in follower.events(idle_timeout=60)]
            follower.close()
            # The learner's first heartbeat went out before it took any task, so it is known by now.
            body = cluster.connect().request(
                topology.SCHEDULER, to_wire(StatusRequest(what="learners")), timeout=10
            )
            reported = [row["device"] for row in expect(from_wire(body), StatusReply).learners]
            bound = str(cluster.learners[0].device)
        trained = list(train_plugins.DEVICES)
    finally:
        train_plugins.reset()
    assert kinds[-1] == "completed"
    assert bound == ("cpu" if device == "cpu" else "cuda:0")
    assert reported == [bound]
    assert trained == [(bound, bound)] * spec.clients.total


@pytest.mark.parametrize("device", DEVICES)
def test_a_job_gives_the_cpu_weights_within_float_error_on_any_device(
    tmp_path: Path, device: str, embedded_runs: EmbeddedRuns
) -> None:
    spec = small_job(clients__total=8, clients__per_round=5)
    on_cpu = embedded_runs.weights(spec)
    settings = Settings(state_dir=tmp_path, device=device, log_format="json")
    with ieee_float32():
        result = run_job(spec, settings, idle_timeout=60)
    assert result["status"] == "completed"
    weights = load_state(result["model_path"])[0]
    assert weights.keys() == on_cpu.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, on_cpu[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_a_fused_job_gives_the_unfused_cpu_weights_within_float_error_on_any_device(
    tmp_path: Path, device: str, embedded_runs: EmbeddedRuns
) -> None:
    """Clients trained together (train.fuse: vmapped steps, batched products, padded batches) on
    the device land where the same clients trained one by one on the CPU do."""
    spec = small_job(clients__total=8, clients__per_round=5)
    on_cpu = embedded_runs.weights(spec)
    fused = spec.model_copy(update={"train": spec.train.model_copy(update={"fuse": True})})
    settings = Settings(state_dir=tmp_path, device=device, log_format="json")
    with ieee_float32():
        result = run_job(fused, settings, idle_timeout=60)
    assert result["status"] == "completed"
    assert result["fused_groups"] == [5] * spec.rounds, "each round's clients trained as one group"
    weights = load_state(result["model_path"])[0]
    assert weights.keys() == on_cpu.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, on_cpu[name], rtol=RTOL, atol=ATOL, msg=name)
