"""Which device a learner binds (seed 004): explicit, spread by replica, or a clear error."""

from __future__ import annotations

import pytest
import torch

from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.errors import ConfigError
from fedmq.common.settings import Settings
from fedmq.services.learner.device import resolve_device
from fedmq.services.learner.service import LearnerService


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_cpu_is_cpu_whatever_gpus_there_are(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 4)
    assert resolve_device("cpu", 3) == torch.device("cpu")


def test_auto_without_gpus_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 0)
    assert resolve_device("auto", 5) == torch.device("cpu")


@pytest.mark.parametrize(("replica", "expected"), [(0, 0), (1, 1), (2, 0), (3, 1)])
def test_auto_spreads_replicas_over_the_visible_gpus(
    monkeypatch: pytest.MonkeyPatch, replica: int, expected: int
) -> None:
    fake_gpus(monkeypatch, 2)
    assert resolve_device("auto", replica) == torch.device("cuda", expected)
    assert resolve_device("cuda", replica) == torch.device("cuda", expected)


def test_an_explicit_gpu_index_is_taken_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    assert resolve_device("cuda:1", 0) == torch.device("cuda", 1)


def test_a_gpu_that_does_not_exist_is_a_clear_start_up_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    with pytest.raises(ConfigError, match=r"FEDMQ_DEVICE=cuda:2 but only 2 GPU\(s\) are visible"):
        resolve_device("cuda:2", 0)


def test_asking_for_a_missing_gpu_says_what_to_check(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        resolve_device("cuda", 0)


def test_a_learner_checks_its_device_when_it_is_built_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    fake_gpus(monkeypatch, 1)
    assert LearnerService(Settings(device="cuda", state_dir=tmp_path), MemoryBroker().connect(),
                          replica=3).device == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="FEDMQ_DEVICE=cuda:1 but only 1 GPU"):
        LearnerService(Settings(device="cuda:1", state_dir=tmp_path), MemoryBroker().connect())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_gpu_trains_a_client() -> None:
    import fedmq
    from fedmq.common.seeding import torch_generator
    from fedmq.common.task.runtime import TaskRuntime
    from tests.conftest import small_job
    from tests.support.simulate import settings

    rt = TaskRuntime.for_job(small_job())
    cuda = torch.device("cuda", 0)
    model = rt.build_model().to(cuda)
    ctx = fedmq.TrainContext(
        client=0, round=1, seed=rt.spec.seed, train=settings(rt.spec), device=cuda,
        generator=torch_generator(rt.spec.seed, "train", 1, 0),
        global_weights={k: v.clone() for k, v in model.state_dict().items()},
    )
    result = rt.train(model, rt.load_data(0, None), ctx)
    assert result.num_examples > 0
    assert all(p.device.type == "cuda" for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_on_a_gpu_loads_the_rounds_next_clients_from_its_copy_there() -> None:
    from fedmq.common.task.runtime import TaskRuntime
    from fedmq.services.learner.work import JobContext
    from tests.conftest import small_job

    rt = TaskRuntime.for_job(small_job())
    job = JobContext(spec=rt.spec, runtime=rt, model=rt.build_model().to("cuda"))
    first = {k: torch.randn_like(v, device="cpu") if v.is_floating_point() else v.cpu()
             for k, v in job.model.state_dict().items()}
    second = {k: v + 1 if v.is_floating_point() else v for k, v in first.items()}
    job.load(first, 1, 0, "d1")
    assert job.on_device is not None and job.on_device[0] == "d1"
    with torch.no_grad():
        for tensor in job.model.state_dict().values():
            tensor.zero_()  # as training changes it
    job.load({}, 1, 1, "d1")  # from the device's copy: the host's weights are not read again
    assert all(torch.equal(v.cpu(), first[k]) for k, v in job.model.state_dict().items())
    job.load(second, 2, 0, "d2")  # a new global model replaces the copy
    assert job.on_device is not None and job.on_device[0] == "d2"
    assert all(torch.equal(v.cpu(), second[k]) for k, v in job.model.state_dict().items())
