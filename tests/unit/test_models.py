"""Building models: built-in shapes, seeded initialisation and user builders."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from torch import nn

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import ModelSpec
from fedmq.common.workloads.models import build_model

DIGITS_SHAPE = (1, 8, 8)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_mlp_for_digits_is_64_128_10() -> None:
    model = build_model(ModelSpec(name="mlp", hidden=[128]), DIGITS_SHAPE, 10, seed=0)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(128, 64), (128,), (10, 128), (10,)]


def test_mlp_without_hidden_layers_is_a_linear_classifier() -> None:
    model = build_model(ModelSpec(name="mlp", hidden=[]), DIGITS_SHAPE, 10, seed=0)
    assert [tuple(p.shape) for p in model.parameters()] == [(10, 64), (10,)]


@pytest.mark.parametrize(
    ("shape", "channels"), [(DIGITS_SHAPE, [16, 32]), ((3, 2, 2), [4, 4, 4]), ((1, 28, 28), [8])]
)
def test_cnn_maps_a_batch_of_images_to_class_logits(
    shape: tuple[int, ...], channels: list[int]
) -> None:
    model = build_model(ModelSpec(name="cnn", channels=channels), shape, 10, seed=0)
    assert model(torch.rand(5, *shape)).shape == (5, 10)


def test_cnn_rejects_inputs_that_are_not_images() -> None:
    with pytest.raises(ConfigError, match="channels, height, width"):
        build_model(ModelSpec(name="cnn"), (64,), 10, seed=0)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_the_same_seed_gives_bit_identical_weights(name: Literal["mlp", "cnn"]) -> None:
    spec = ModelSpec(name=name)
    assert same_weights(
        build_model(spec, DIGITS_SHAPE, 10, 1), build_model(spec, DIGITS_SHAPE, 10, 1)
    )


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_different_seeds_give_different_weights(name: Literal["mlp", "cnn"]) -> None:
    spec = ModelSpec(name=name)
    assert not same_weights(
        build_model(spec, DIGITS_SHAPE, 10, 1), build_model(spec, DIGITS_SHAPE, 10, 2)
    )


def test_building_a_model_leaves_the_global_torch_rng_untouched() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    build_model(ModelSpec(name="cnn"), DIGITS_SHAPE, 10, seed=9)
    assert torch.equal(torch.get_rng_state(), before)


def test_an_entrypoint_model_is_built_with_its_options_and_seeded() -> None:
    spec = ModelSpec(entrypoint="examples.plugins.my_model:build", options={"width": 7})
    model = build_model(spec, (4,), 3, seed=0)
    assert model(torch.zeros(2, 4)).shape == (2, 3)
    assert any(tuple(p.shape) == (7, 4) for p in model.parameters())
    assert same_weights(model, build_model(spec, (4,), 3, seed=0))


def wrong_width(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3, num_classes))


def wrong_outputs(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes + 1))


def not_a_module(input_shape: tuple[int, ...], num_classes: int) -> dict[str, int]:
    return {"layers": 2}


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("no_such_pkg.nets:build", "module 'no_such_pkg.nets' not found"),
        ("examples.plugins.my_model:missing", "has no attribute 'missing'"),
        (f"{__name__}:not_a_module", "expected a torch.nn.Module"),
        (f"{__name__}:wrong_width", "fails on a batch"),
        (f"{__name__}:wrong_outputs", r"\(B, 10\) logits"),
    ],
)
def test_a_bad_entrypoint_model_is_a_config_error_naming_it(ref: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_model(ModelSpec(entrypoint=ref), DIGITS_SHAPE, 10, seed=0)
    assert ref in str(info.value)


def test_unknown_options_for_an_entrypoint_model_are_a_config_error() -> None:
    spec = ModelSpec(entrypoint="examples.plugins.my_model:build", options={"depth": 3})
    with pytest.raises(ConfigError, match="depth"):
        build_model(spec, DIGITS_SHAPE, 10, seed=0)
