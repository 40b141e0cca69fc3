"""Loading an aggregate computed tensor by tensor (kernels.WeightedMean) into the global model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedmq.common.strategy.contract import ClientResult
from fedmq.services.aggregator.jobs import views
from fedmq.services.aggregator.kernels.clip import ClippedWeights
from fedmq.services.aggregator.kernels.mean import WeightedMean
from fedmq.services.aggregator.rounds import load_weights
from fedmq.services.aggregator.strategies.fedavg import FedAvg


class Tied(nn.Module):
    """An embedding and an output head sharing one weight: one storage under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_read_through_the_current_model_are_averaged_before_any_is_written() -> None:
    torch.manual_seed(0)
    lazy, eager = Tied(), Tied()
    eager.load_state_dict(lazy.state_dict())
    before = lazy.emb.weight.detach().clone()
    for model, as_dict in ((lazy, False), (eager, True)):
        current = views(model)
        moved = {name: t.clone() + 1.0 for name, t in current.items()}
        # A clipped update reads the current model when looked up: half of the +1 move.
        mean = WeightedMean([(ClippedWeights(moved, current, 0.5), 1.0)])
        load_weights(model, dict(mean) if as_dict else mean)
    assert torch.equal(lazy.emb.weight, eager.emb.weight)
    assert torch.allclose(lazy.emb.weight - before, torch.full_like(before, 0.5))


def test_a_fedavg_variant_with_its_own_average_is_aggregated_with_it() -> None:
    class Halved(FedAvg):
        def average(self, results: Sequence[ClientResult]) -> dict[str, torch.Tensor]:
            return {name: t / 2 for name, t in super().average(results).items()}

    result = ClientResult(client=0, num_examples=3, loader=lambda: {"w": torch.ones(2)})
    out = Halved().aggregate(None, {"w": torch.zeros(2)}, [result], [])  # type: ignore[arg-type]
    assert torch.equal(dict(out.weights)["w"], torch.full((2,), 0.5))
