"""What a strategy is: given the round's results, decide the new global model. It never sends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ClientResult:
    """One client's accepted update; weights load lazily so a round streams through memory."""

    client: int
    num_examples: int
    load: Callable[[], Mapping[str, torch.Tensor]]
    metrics: dict[str, float] = field(default_factory=dict)


class Strategy(ABC):
    """Server-side algorithm. State it carries across rounds is exposed for checkpoints."""

    @abstractmethod
    def aggregate(
        self, server_round: int, current: StateDict, results: Sequence[ClientResult]
    ) -> StateDict:
        """Return the next global weights from the current ones and the round's results."""

    def state(self) -> StateDict:
        """Tensors to checkpoint beside the global weights (e.g. server momentum)."""
        return {}

    def load_state(self, state: StateDict) -> None:  # noqa: B027 - stateless strategies need nothing
        """Restore what `state()` returned."""
