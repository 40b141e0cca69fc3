"""Which device a learner trains on (seed 004: one process per GPU, spread by replica)."""

from __future__ import annotations

import torch

from fedmq.common.errors import ConfigError


def resolve_device(setting: str, replica: int) -> torch.device:
    """`cpu`, `cuda:N` exactly; `cuda` and `auto` spread replicas over the visible GPUs.

    CUDA_VISIBLE_DEVICES is honoured because torch only counts the GPUs it exposes.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if setting == "cpu" or (setting == "auto" and count == 0):
        return torch.device("cpu")
    if count == 0:
        raise ConfigError(
            f"FEDMQ_DEVICE={setting} asks for a GPU but torch sees none "
            "(check the driver, CUDA_VISIBLE_DEVICES and that torch is a CUDA build), "
            "or set FEDMQ_DEVICE=cpu"
        )
    if setting.startswith("cuda:"):
        index = int(setting.split(":", 1)[1])
        if index >= count:
            raise ConfigError(
                f"FEDMQ_DEVICE={setting} but only {count} GPU(s) are visible (cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    return torch.device("cuda", replica % count)
