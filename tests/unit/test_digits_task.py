"""The built-in digits Task: its data, split, clients' shares, models and seeded initialisation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import parse_job
from fedmq.common.task.runtime import TaskRuntime


def runtime(seed: int = 0, clients: int = 10, **options: Any) -> TaskRuntime:
    spec = parse_job({"name": "d", "seed": seed, "clients": {"total": clients}, "rounds": 1,
                      "task": {"name": "digits", "options": options}})
    return TaskRuntime.for_job(spec)


def arrays(rt: TaskRuntime) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    x_test, y_test = rt.load_server_data(None)
    parts = [rt.load_data(c, None).train for c in range(rt.spec.clients.total)]
    x = torch.cat([p[0] for p in parts]).numpy()
    y = torch.cat([p[1] for p in parts]).numpy()
    return x, y, x_test.numpy(), y_test.numpy()


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_clients_share_the_training_split_and_the_server_holds_the_rest() -> None:
    x, y, x_test, y_test = arrays(runtime())
    assert len(x) + len(x_test) == 1797
    assert x.shape[1:] == x_test.shape[1:] == (1, 8, 8)
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert set(np.unique(y)) == set(range(10)) and np.isfinite(x).all()


def test_pixels_are_standardised_with_training_statistics() -> None:
    x, _, x_test, _ = arrays(runtime())
    mean, std = x.mean(axis=0), x.std(axis=0)
    assert np.allclose(mean, 0.0, atol=1e-5)
    assert np.allclose(std[std > 1e-3], 1.0, atol=1e-4)  # constant pixels (corners) stay at zero
    assert abs(float(x_test.mean())) < 0.2


def test_the_held_out_split_is_stratified_by_class() -> None:
    _, y, _, y_test = arrays(runtime(seed=1, test_fraction=0.3))
    expected = np.bincount(np.concatenate([y, y_test]), minlength=10) * 0.3
    assert np.all(np.abs(np.bincount(y_test, minlength=10) - expected) <= 1)


def test_the_same_seed_gives_the_same_split_and_another_seed_another() -> None:
    first, again, other = arrays(runtime(seed=3)), arrays(runtime(seed=3)), arrays(runtime(seed=4))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(first[2], other[2])


def test_each_client_also_holds_a_slice_of_the_held_out_split_to_validate_on() -> None:
    rt = runtime(clients=4)
    sizes = [len(rt.load_data(c, None).val[1]) for c in range(4)]
    assert sum(sizes) == len(rt.load_server_data(None)[1]) and min(sizes) > 0


def test_mlp_for_digits_is_64_128_10_and_cnn_maps_images_to_logits() -> None:
    mlp = runtime().build_model()
    assert [tuple(p.shape) for p in mlp.parameters()] == [(128, 64), (128,), (10, 128), (10,)]
    cnn = runtime(model={"name": "cnn", "channels": [16, 32]}).build_model()
    assert cnn(torch.rand(5, 1, 8, 8)).shape == (5, 10)


@pytest.mark.parametrize("model", [{"name": "mlp"}, {"name": "cnn"}])
def test_initial_weights_depend_on_the_seed_only(model: dict[str, Any]) -> None:
    assert same_weights(runtime(1, model=model).build_model(), runtime(1, model=model).build_model())
    assert not same_weights(runtime(1, model=model).build_model(), runtime(2, model=model).build_model())


def test_building_a_model_leaves_the_global_torch_rng_untouched() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    runtime(9, model={"name": "cnn"}).build_model()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"model": {"name": "mlp", "hidden": [0]}}, "task.options.model.hidden.0"),
        ({"model": {"name": "resnet"}}, "task.options.model"),
        ({"test_fraction": 1.5}, "task.options.test_fraction"),
        ({"partition": {"kind": "dirichlet", "alpha": -1}}, "task.options.partition.alpha"),
        ({"parition": {}}, "task.options.parition"),
    ],
)
def test_bad_options_are_refused_naming_the_option(options: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        runtime(**options)


def test_the_digits_table_is_scikit_learns_read_without_importing_it() -> None:
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from fedmq.tasks.digits import _raw_digits

    pixels, labels = _raw_digits()
    reference = load_digits()
    assert pixels.dtype == reference.data.dtype and np.array_equal(pixels, reference.data)
    assert labels.dtype == reference.target.dtype and np.array_equal(labels, reference.target)
    # A process that loads the Task's data never imports scikit-learn (78 MiB of its memory).
    probe = ("import sys; from fedmq.tasks.digits import _standardised; _standardised(0.2, 0); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
