"""The loop's metric sums: kept per step, summed at the end to the bits of a step-by-step float64 sum."""

from __future__ import annotations

import pytest
import torch

from fedmq.common.task.loop import _Sums


def test_sums_kept_per_step_are_the_step_by_step_float64_sums_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    steps: list[tuple[torch.Tensor, dict[str, torch.Tensor | float], int]] = [
        (torch.rand((), generator=gen) * 7, {"acc": torch.rand((), generator=gen), "lr": 0.1 * (i + 1)},
         int(torch.randint(1, 33, (), generator=gen))) for i in range(57)]
    steps[5][1]["late"] = torch.tensor(2.5, dtype=torch.float16)  # a metric only some steps return
    steps[9][1]["late"] = torch.tensor([1.25])  # of another dtype and shape
    sums = _Sums(torch.device("cpu"))
    expected: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for loss, metrics, size in steps:
        sums.add(loss, metrics, size)
        for name, value in {"loss": loss, **metrics}.items():  # as the loop summed before
            value = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            term = value.to(torch.float64).reshape(()) * size
            expected[name] = expected[name] + term if name in expected else term
            counts[name] = counts.get(name, 0) + 1
    seen = sum(size for _, _, size in steps)
    assert sums.means(seen) == {name: float(v) / seen for name, v in expected.items()}
    assert counts["late"] == 2 and _Sums(torch.device("cpu")).means(seen) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sums_of_scalar_tensors_only_read_at_once_have_the_float64_bits_too(dtype: torch.dtype) -> None:
    # The common case (every value a 0-dim float tensor of one dtype) is read in one stack and
    # multiplied in Python: the same float64 products, added in the same order.
    gen = torch.Generator().manual_seed(5)
    sums = _Sums(torch.device("cpu"))
    expected: dict[str, torch.Tensor] = {}
    seen = 0
    for _ in range(41):
        loss, acc = (torch.rand((), generator=gen) * 9).to(dtype), torch.rand((), generator=gen).to(dtype)
        size = int(torch.randint(1, 33, (), generator=gen))
        sums.add(loss, {"acc": acc}, size)
        seen += size
        for name, value in (("loss", loss), ("acc", acc)):
            term = value.to(torch.float64) * size
            expected[name] = expected[name] + term if name in expected else term
    assert sums.means(seen) == {name: float(v) / seen for name, v in expected.items()}


class _Counting:
    """A loss that reports how many times it was called, as a float metric."""

    lean_memory = True

    def __init__(self) -> None:
        self.calls = 0

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict]:
        self.calls += 1
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y), {"call": float(self.calls)}


def _train(epochs: int, max_steps: int | None) -> dict[str, float]:
    from fedmq.common.task.contract import TrainContext, TrainSettings
    from fedmq.common.task.loop import train_with_loss

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = (torch.randn(6, 2), torch.randn(6, 1))  # batches of 4 and 2 examples
    settings = TrainSettings(epochs=epochs, batch_size=4, max_steps=max_steps)
    ctx = TrainContext(client=0, round=1, seed=0, train=settings, device=torch.device("cpu"),
                       generator=torch.Generator().manual_seed(0), global_weights={})
    return dict(train_with_loss(_Counting(), model, data, ctx).metrics)  # type: ignore[arg-type]


def test_the_result_holds_the_last_epochs_metrics_and_max_steps_ends_an_epoch_early() -> None:
    # Three epochs of two steps: the last epoch's calls were the 5th (4 examples) and 6th (2).
    assert _train(3, None)["call"] == (5 * 4 + 6 * 2) / 6
    # max_steps 3 stops after the second epoch's first step (4 examples): that step alone.
    assert _train(3, 3)["call"] == 3.0


def test_a_metric_named_loss_replaces_the_loss_as_before() -> None:
    sums = _Sums(torch.device("cpu"))
    sums.add(torch.tensor(1.0), {"loss": 5.0}, 2)
    assert sums.means(2) == {"loss": 5.0}
