"""A client's weights with its update scaled down, tensor by tensor when looked up:

    wₖ ← w + s·(wₖ − w)        computed in float64, rounded to the tensor's dtype; other tensors pass

What the `clipped` strategy hands its inner strategy, and what the round loop hands any strategy
for an update longer than clients.max_update_norm (on_large_update: clip). The scale comes from
the caller (private.delta_norm); the tensors are read from the mappings given, once per lookup.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


class ClippedWeights(Mapping[str, torch.Tensor]):
    """w + scale·(new − w), tensor by tensor when looked up: a client's weights with a shrunk delta."""

    def __init__(self, new: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor], scale: float):
        self._new, self._current, self._scale = new, current, scale

    def __getitem__(self, name: str) -> torch.Tensor:
        new = self._new[name]
        if not new.dtype.is_floating_point:
            return new
        base = self._current[name].to(torch.float64)
        return (new.to(torch.float64) - base).mul_(self._scale).add_(base).to(new.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._new)

    def __len__(self) -> int:
        return len(self._new)
