"""Networks a job can train: built-in `mlp` and `cnn` or a user's builder, seeded at init."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import ModelSpec
from fedmq.common.seeding import derive_seed
from fedmq.common.workloads.plugins import check_arguments, load_entrypoint


def build_model(
    spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int, seed: int
) -> nn.Module:
    """An untrained model whose weights depend only on (spec, shapes, seed).

    Construction runs in a forked CPU RNG seeded from `seed`, so the caller's global
    torch RNG state is left exactly as it was.
    """
    input_shape = tuple(int(d) for d in input_shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "init"))
        # `name` keeps its default when `entrypoint` is given, so the entrypoint decides first.
        if spec.entrypoint is not None:
            model = _from_entrypoint(spec, input_shape, num_classes)
        elif spec.name == "mlp":
            model = mlp(input_shape, num_classes, spec.hidden)
        elif spec.name == "cnn":
            model = cnn(input_shape, num_classes, spec.channels)
        else:
            raise ConfigError("model: give a model 'name' (mlp, cnn) or an 'entrypoint'")
        _check_output(model, input_shape, num_classes, spec.entrypoint or str(spec.name))
    return model


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: list[int]) -> nn.Sequential:
    """Flatten, then Linear+ReLU per hidden width, then a Linear to the class logits."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape: tuple[int, ...], num_classes: int, channels: list[int]) -> nn.Sequential:
    """Conv3x3+ReLU(+MaxPool2 while the image is at least 2x2) per channel count, then Linear."""
    if len(input_shape) != 3:
        raise ConfigError(
            f"model 'cnn' needs images shaped (channels, height, width), got {input_shape}"
        )
    in_channels, height, width = input_shape
    layers: list[nn.Module] = []
    for out_channels in channels:
        layers += [nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1), nn.ReLU()]
        if height >= 2 and width >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        in_channels = out_channels
    layers += [nn.Flatten(), nn.Linear(in_channels * height * width, num_classes)]
    return nn.Sequential(*layers)


def _from_entrypoint(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    ref = spec.entrypoint or ""
    builder = load_entrypoint(ref)
    kwargs: dict[str, Any] = {"input_shape": input_shape, "num_classes": num_classes}
    kwargs.update(spec.options)
    check_arguments(builder, ref, **kwargs)
    model = builder(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model entrypoint {ref!r} returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


def _check_output(
    model: nn.Module, input_shape: tuple[int, ...], num_classes: int, source: str
) -> None:
    """Run two zero samples through the model so a shape mistake fails here, not mid-round."""
    was_training = model.training
    model.eval()  # no batch-norm statistics change, no dropout draws
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape))
    except Exception as exc:
        raise ConfigError(
            f"model {source!r} fails on a batch shaped (2, {', '.join(map(str, input_shape))}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model {source!r} must map (B, *{input_shape}) to (B, {num_classes}) logits, "
            f"got {shape}"
        )
