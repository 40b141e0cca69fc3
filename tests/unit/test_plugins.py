"""Resolving plug-in references and the example plug-in meeting its contracts."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import DataSpec, ModelSpec, TrainSpec
from fedmq.common.seeding import torch_generator
from fedmq.common.workloads.datasets import load_dataset
from fedmq.common.workloads.models import build_model
from fedmq.common.workloads.plugins import LocalTrainFn, load_entrypoint

NOT_CALLABLE = 3


def test_a_reference_resolves_to_the_named_function() -> None:
    from examples.plugins import my_model

    assert load_entrypoint("examples.plugins.my_model:build") is my_model.build


@pytest.mark.parametrize("ref", ["no_colon", ":func", "pkg.mod:", ""])
def test_a_malformed_reference_is_a_config_error(ref: str) -> None:
    with pytest.raises(ConfigError, match="package.module:function"):
        load_entrypoint(ref)


def test_a_missing_module_is_named_as_missing() -> None:
    with pytest.raises(ConfigError, match="module 'fedmq_nowhere.mod' not found") as info:
        load_entrypoint("fedmq_nowhere.mod:build")
    assert "'fedmq_nowhere.mod:build'" in str(info.value)


def test_a_missing_attribute_is_named_as_missing() -> None:
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_entrypoint("examples.plugins.my_model:nope")


def test_a_non_callable_attribute_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not callable"):
        load_entrypoint(f"{__name__}:NOT_CALLABLE")


@pytest.fixture
def broken_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module that exists but whose own import fails on a missing dependency."""
    name = "fedmq_test_broken_plugin"
    (tmp_path / f"{name}.py").write_text("import fedmq_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_module_whose_dependency_is_missing_says_so(broken_module: str) -> None:
    with pytest.raises(ConfigError, match="failed to import") as info:
        load_entrypoint(f"{broken_module}:build")
    assert "fedmq_missing_dependency" in str(info.value)


def test_the_example_plugin_trains_end_to_end() -> None:
    data = load_dataset(DataSpec(entrypoint="examples.plugins.my_model:load"), seed=0)
    model = build_model(
        ModelSpec(entrypoint="examples.plugins.my_model:build"),
        data.input_shape,
        data.num_classes,
        seed=0,
    )
    train_fn: LocalTrainFn = load_entrypoint("examples.plugins.my_model:train")
    x, y = torch.tensor(data.x_train), torch.tensor(data.y_train)
    spec = TrainSpec(epochs=3, batch_size=16, lr=0.1)
    metrics = train_fn(model, x, y, spec, torch_generator(0, "train", 0, 0), torch.device("cpu"))
    assert {"loss", "accuracy"} <= metrics.keys()
    with torch.no_grad():
        correct = model(torch.tensor(data.x_test)).argmax(1) == torch.tensor(data.y_test)
    assert correct.float().mean() > 0.8


def test_the_example_training_is_reproducible_from_its_generator() -> None:
    from examples.plugins.my_model import build, train

    x, y = torch.randn(40, 2), torch.arange(40) % 3
    spec = TrainSpec(epochs=1, batch_size=8, max_steps=3)
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build((2,), 3)
        metrics = train(model, x, y, spec, torch_generator(1, "train"), torch.device("cpu"))
        results.append((metrics, [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    assert results[0][0]["steps"] == 3
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
