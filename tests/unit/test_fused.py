"""Fused training of a round's clients against the sequential loop, client by client.

The reference is `train_with_loss`, one client at a time from the same weights with the same
generator: fused training must draw the same batches and land within float tolerance.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fedmq.common.task.contract import ClientData, Task, TrainContext, TrainSettings
from fedmq.common.task.fused import can_fuse, group_size, train_fused
from fedmq.common.task.loop import train_with_loss

TOLERANCE = 1e-5  # float32 weights after a few dozen steps; batched products reduce in another order
SIZES = [3, 35, 17, 8, 8, 26, 11, 30]  # ragged, as Dirichlet-skewed clients are
NORM_SIZES = [3, 34, 18, 8, 8, 26, 12, 30]  # no batch of one (of 8): BatchNorm refuses it in training


class Mlp(Task):
    def __init__(
        self, dropout: float = 0.0, norm: bool = False, summed: bool = False, momentum: float | None = 0.1
    ) -> None:
        self.dropout, self.norm, self.summed, self.momentum = dropout, norm, summed, momentum

    def build_model(self) -> nn.Module:
        # No bias before BatchNorm, as usual: it cancels it, and Adam would scale that bias's
        # gradient (zero up to rounding) into steps that differ in every run's rounding.
        layers: list[nn.Module] = [nn.Linear(6, 16, bias=not self.norm)]
        layers += [nn.BatchNorm1d(16, momentum=self.momentum)] if self.norm else []
        layers += [nn.ReLU(), nn.Dropout(self.dropout)] if self.dropout else [nn.ReLU()]
        layers += [nn.Linear(16, 3)]
        return nn.Sequential(*layers)

    def load_data(self, ctx: Any) -> ClientData:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        x, y = batch
        logits = model(x)
        reduction = "sum" if self.summed else "mean"  # a sum is no mean over examples: no padding then
        loss = nn.functional.cross_entropy(logits, y, reduction=reduction)
        return loss, {"accuracy": (logits.argmax(1) == y).float().mean()}


def clients(sizes: list[int] = SIZES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def contexts(
    model: nn.Module, count: int, settings: TrainSettings, config: dict[str, Any] | None = None
) -> list[TrainContext]:
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return [
        TrainContext(client=i, round=1, seed=5, train=settings, device=torch.device("cpu"),
                     generator=torch.Generator().manual_seed(100 + i), global_weights=weights,
                     config=config or {})
        for i in range(count)
    ]


def model_for(task: Mlp) -> nn.Module:
    torch.manual_seed(0)
    return task.build_model()


SETTINGS = {
    "sgd": TrainSettings(epochs=2, batch_size=8, lr=0.1),
    "sgd-momentum-decay": TrainSettings(epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": TrainSettings(epochs=2, batch_size=8, optimizer="adam", lr=0.01, weight_decay=1e-4),
}


@pytest.mark.parametrize("summed", [False, True], ids=["mean-loss-padded", "sum-loss-grouped-by-size"])
@pytest.mark.parametrize("proximal", [0.0, 0.5], ids=["plain", "fedprox"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_fused_training_lands_within_tolerance_of_the_sequential_loop(
    name: str, proximal: float, summed: bool
) -> None:
    task, data = Mlp(summed=summed), clients()
    model = model_for(task)
    config = {"proximal_mu": proximal} if proximal else {}
    fused = train_fused(task, model, data, contexts(model, len(data), SETTINGS[name], config))
    assert fused is not None
    start = {n: p.detach().clone() for n, p in model.state_dict().items()}
    sequential = contexts(model, len(data), SETTINGS[name], config)
    for i, (ctx, batch) in enumerate(zip(sequential, data, strict=True)):
        one = model_for(task)
        one.load_state_dict(start)
        result = train_with_loss(task, one, batch, ctx)
        assert fused[i].result.num_examples == result.num_examples == len(batch[0])
        for n, p in one.named_parameters():
            gap = float((fused[i].weights[n] - p.detach()).abs().max())
            assert gap < TOLERANCE, f"client {i} {n}: fused is {gap:.2e} from sequential"
            assert not torch.equal(fused[i].weights[n], start[n]), "the client trained"
        assert set(fused[i].result.metrics) == {"loss", "accuracy"}
        for metric, value in result.metrics.items():
            assert fused[i].result.metrics[metric] == pytest.approx(value, abs=1e-5)


@pytest.mark.parametrize("summed", [False, True], ids=["mean-loss", "sum-loss"])
def test_a_first_client_of_one_example_does_not_decide_how_clients_are_batched(summed: bool) -> None:
    # A batch of one is its own mean whatever the loss: the probe waits for a larger batch.
    task, data = Mlp(summed=summed), clients([1, 9, 17, 4])
    model = model_for(task)
    fused = train_fused(task, model, data, contexts(model, len(data), SETTINGS["sgd"]))
    assert fused is not None
    start = {n: p.detach().clone() for n, p in model.state_dict().items()}
    for i, (ctx, batch) in enumerate(zip(contexts(model, len(data), SETTINGS["sgd"]), data, strict=True)):
        one = model_for(task)
        one.load_state_dict(start)
        train_with_loss(task, one, batch, ctx)
        gap = max(float((fused[i].weights[n] - p.detach()).abs().max()) for n, p in one.named_parameters())
        assert gap < TOLERANCE, f"client {i}: fused is {gap:.2e} from sequential"


def test_a_fused_run_is_bit_identical_with_itself_and_leaves_the_model_alone() -> None:
    task, data = Mlp(), clients()
    model = model_for(task)
    model.eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    runs = [train_fused(task, model, data, contexts(model, len(data), SETTINGS["adam"])) for _ in range(2)]
    assert runs[0] is not None and runs[1] is not None
    for a, b in zip(runs[0], runs[1], strict=True):
        assert all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)
        assert a.result == b.result
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not model.training, "the model's mode is as it was"


@pytest.mark.parametrize("max_steps", [1, 3, 7, 100])
def test_max_steps_ends_each_clients_training_where_the_sequential_loop_ends_it(max_steps: int) -> None:
    # Ragged clients over 2 epochs of batches of 8: 1 to 5 batches an epoch, so a client stops in its
    # first epoch, at an epoch's end, in its second, or (100) runs both out. Each ends with the loop's
    # weights (within tolerance), example count and metrics of the epoch it stopped in, and with its
    # generator where the loop leaves it: the same batches drawn, none more.
    task, data = Mlp(), clients()
    model = model_for(task)
    settings = TrainSettings(epochs=2, batch_size=8, lr=0.1, max_steps=max_steps)
    ctxs = contexts(model, len(data), settings)
    fused = train_fused(task, model, data, ctxs)
    assert fused is not None
    start = {n: p.detach().clone() for n, p in model.state_dict().items()}
    for i, (ctx, batch) in enumerate(zip(contexts(model, len(data), settings), data, strict=True)):
        one = model_for(task)
        one.load_state_dict(start)
        result = train_with_loss(task, one, batch, ctx)
        assert fused[i].result.num_examples == result.num_examples, i
        for n, p in one.named_parameters():
            gap = float((fused[i].weights[n] - p.detach()).abs().max())
            assert gap < TOLERANCE, f"client {i} {n}: fused is {gap:.2e} from sequential"
        assert fused[i].result.metrics.keys() == result.metrics.keys()
        for metric, value in result.metrics.items():
            assert fused[i].result.metrics[metric] == pytest.approx(value, abs=1e-5), (i, metric)
        assert torch.equal(ctxs[i].generator.get_state(), ctx.generator.get_state()), f"client {i}'s draws"


class Counted(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style Dataset (no tensor bank: its batches are read as drawn) that counts its reads."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.reads = x, y, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return self.x[i], self.y[i]


def test_max_steps_reads_no_example_past_its_last_step() -> None:
    task = Mlp()
    model = model_for(task)
    settings = TrainSettings(epochs=2, batch_size=8, lr=0.1, max_steps=2)
    fused_data = [Counted(*d) for d in clients()]
    fused = train_fused(task, model, fused_data, contexts(model, len(fused_data), settings))
    assert fused is not None
    start = {n: p.detach().clone() for n, p in model.state_dict().items()}
    ctxs = contexts(model, len(fused_data), settings)
    for i, (ctx, (x, y)) in enumerate(zip(ctxs, clients(), strict=True)):
        alone = Counted(x, y)
        one = model_for(task)
        one.load_state_dict(start)
        train_with_loss(task, one, alone, ctx)
        assert fused_data[i].reads == alone.reads, (i, fused_data[i].reads, alone.reads)


@pytest.mark.parametrize("why", ["dropout", "dataloader", "scaffold", "frozen"])
def test_what_cannot_be_fused_answers_none_so_the_caller_trains_one_by_one(why: str) -> None:
    task = Mlp(dropout=0.5 if why == "dropout" else 0.0)
    model = model_for(task)
    if why == "frozen":
        next(model.parameters()).requires_grad_(False)
    data: list[Any] = clients()
    settings = TrainSettings(epochs=1, batch_size=8)
    config = {"scaffold": True} if why == "scaffold" else {}
    if why == "dataloader":
        data = [torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*d), batch_size=8) for d in data]
    ctxs = contexts(model, len(data), settings, config)
    states = [ctx.generator.get_state() for ctx in ctxs]
    assert train_fused(task, model, data, ctxs) is None
    # A fallback draws the same batches: fusing gave up (dropout: at its first step) without a draw.
    assert all(torch.equal(ctx.generator.get_state(), state) for ctx, state in zip(ctxs, states, strict=True))


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_batchnorm_fuses_with_each_clients_running_statistics_its_own(
    name: str, momentum: float | None
) -> None:
    task, data = Mlp(norm=True, momentum=momentum), clients(NORM_SIZES)
    model = model_for(task)
    fused = train_fused(task, model, data, contexts(model, len(data), SETTINGS[name]))
    assert fused is not None
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    assert any("running_mean" in n for n in start)
    for i, (ctx, batch) in enumerate(zip(contexts(model, len(data), SETTINGS[name]), data, strict=True)):
        one = model_for(task)
        one.load_state_dict(start)
        train_with_loss(task, one, batch, ctx)
        for n, t in one.state_dict().items():  # parameters, running mean and variance, batch count
            assert fused[i].weights[n].dtype == t.dtype
            gap = float((fused[i].weights[n].double() - t.double()).abs().max())
            assert gap < TOLERANCE, f"client {i} {n}: fused is {gap:.2e} from sequential"
            assert not torch.equal(fused[i].weights[n], start[n]), f"client {i} {n} moved"
    assert torch.equal(model.state_dict()["1.running_mean"], start["1.running_mean"]), "model untouched"
    assert "forward" not in vars(model.get_submodule("1")), "its BatchNorm computes with torch's kernel again"


def test_a_client_with_a_batch_of_one_in_batchnorm_fails_alone_and_the_rest_train_as_alone() -> None:
    task, data = Mlp(norm=True), clients([9, 16, 12])  # 9 of 8: a last batch of one
    model = model_for(task)
    together = train_fused(task, model, data, contexts(model, 3, SETTINGS["sgd"]))
    assert together is not None
    error = together[0].error
    assert isinstance(error, ValueError) and "Expected more than 1 value per channel" in str(error)
    one = model_for(task)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        train_with_loss(task, one, data[0], contexts(model, 3, SETTINGS["sgd"])[0])  # as it fails alone
    ctxs = contexts(model, 3, SETTINGS["sgd"])
    for i in (1, 2):
        alone = train_fused(task, model, [data[i]], [ctxs[i]])
        assert alone is not None and alone[0].error is None and together[i].error is None
        assert all(torch.equal(w, together[i].weights[n]) for n, w in alone[0].weights.items()), i


class KeptNorm(nn.BatchNorm1d):
    """A subclass that keeps torch's forward: fused, computed as a plain BatchNorm."""


class OwnNorm(nn.BatchNorm1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1.0


@pytest.mark.parametrize("norm", [KeptNorm, OwnNorm, nn.SyncBatchNorm], ids=lambda c: c.__name__)
def test_only_a_batchnorm_with_torchs_own_forward_fuses_its_buffers(norm: type[nn.Module]) -> None:
    model = nn.Sequential(nn.Linear(6, 16, bias=False), norm(16), nn.ReLU(), nn.Linear(16, 3))
    why = can_fuse(model, contexts(model, 1, SETTINGS["sgd"])[0])
    if norm is KeptNorm:
        assert why is None
    else:
        assert why is not None and norm.__name__ in why and "keeps buffers" in why


@pytest.mark.parametrize("hidden", [16, 3276, 3277])
def test_on_a_cpu_a_model_over_the_fused_limit_trains_one_client_at_a_time(hidden: int) -> None:
    # 6 -> hidden -> 3 with biases: 10·hidden + 3 float32 parameters; 3276 at the limit, 3277 past it.
    from fedmq.common.task.fused import FUSE_CPU_MAX_BYTES

    model = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    size = sum(p.numel() * 4 for p in model.parameters())
    why = can_fuse(model, contexts(model, 1, SETTINGS["sgd"])[0])
    if size <= FUSE_CPU_MAX_BYTES:
        assert why is None
    else:
        assert why is not None and "one client at a time on a CPU" in why, why


class Tied(Mlp):
    def build_model(self) -> nn.Module:
        model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
        model[2].weight = model[0].weight  # one parameter under two names
        return model


def test_tied_parameters_fuse_and_stay_tied_under_both_names() -> None:
    task, data = Tied(), clients()
    model = model_for(task)
    fused = train_fused(task, model, data, contexts(model, len(data), SETTINGS["sgd"]))
    assert fused is not None
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    for i, (ctx, batch) in enumerate(zip(contexts(model, len(data), SETTINGS["sgd"]), data, strict=True)):
        one = model_for(task)
        one.load_state_dict(start)
        train_with_loss(task, one, batch, ctx)
        for n, t in one.state_dict().items():
            assert float((fused[i].weights[n] - t).abs().max()) < TOLERANCE, (i, n)
        assert torch.equal(fused[i].weights["0.weight"], fused[i].weights["2.weight"])


def test_the_group_shrinks_with_the_memory_budget() -> None:
    model = model_for(Mlp())
    weights = sum(p.numel() * 4 for p in model.parameters())
    adam = TrainSettings(optimizer="adam")
    assert group_size(model, adam, budget_bytes=weights * 4 * 10) == 10  # weights, grads, m and v
    assert group_size(model, TrainSettings(), budget_bytes=weights * 2 * 10) == 10
    assert group_size(model, adam, budget_bytes=weights) == 1  # too small for two: one at a time


@pytest.mark.parametrize("kind", ["mean-loss-padded", "sum-loss-grouped-by-size", "batchnorm"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_clients_fused_result_is_bit_identical_in_any_group(name: str, kind: str) -> None:
    """Alone, with all, in another order or another split (as learners share a round's tasks)."""
    task = Mlp(summed=kind.startswith("sum"), norm=kind == "batchnorm")
    sizes = [3, 34, 18, 8, 8, 26, 12, 30, 64, 2] if task.norm else [3, 35, 17, 8, 8, 26, 11, 30, 64, 1]
    data = clients(sizes)
    model = model_for(task)

    def grouped(groups: list[list[int]]) -> dict[int, tuple[dict[str, torch.Tensor], Mapping[str, float]]]:
        ctxs = contexts(model, len(data), SETTINGS[name], {"proximal_mu": 0.3})
        out = {}
        for group in groups:
            fused = train_fused(task, model, [data[i] for i in group], [ctxs[i] for i in group])
            assert fused is not None
            out.update({i: (f.weights, f.result.metrics) for i, f in zip(group, fused, strict=True)})
        return out

    together = grouped([list(range(10))])
    splits = [[[i] for i in range(10)], [[0, 4, 7], [1, 2], [3, 5, 6, 8], [9]], [list(range(9, -1, -1))]]
    for groups in splits:
        other = grouped(groups)
        for i, (weights, metrics) in together.items():
            assert metrics == other[i][1], (i, groups)
            assert all(torch.equal(weights[n], other[i][0][n]) for n in weights), (i, groups)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_fused_steps_never_wait_for_the_device() -> None:
    """A round's plan goes to the GPU at once: the host waits for the device as often in a round of
    many steps as in one of few (the first batch's probe, the final read of the metrics)."""
    import warnings

    task, data = Mlp(), clients()
    model = model_for(task).cuda()

    def syncs(epochs: int) -> int:
        settings = TrainSettings(epochs=epochs, batch_size=8, lr=0.1, momentum=0.9)
        ctxs = [dataclasses.replace(ctx, device=torch.device("cuda"))
                for ctx in contexts(model, len(data), settings)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert train_fused(task, model, data, ctxs) is not None
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)

    assert syncs(1) == syncs(4)


@pytest.mark.parametrize("summed", [False, True], ids=["mean-loss-padded", "sum-loss-grouped-by-size"])
def test_a_dataset_trains_fused_to_the_bits_of_the_same_tensors(summed: bool) -> None:
    """A map-style Dataset goes the general way (its batches cut, padded and stacked each step);
    tensors go through one bank and a plan made once a round: the same batches, the same bits."""
    task, data = Mlp(summed=summed), clients()
    model = model_for(task)
    settings = TrainSettings(epochs=2, batch_size=8, lr=0.1, momentum=0.9)
    banked = train_fused(task, model, data, contexts(model, len(data), settings))
    datasets = [torch.utils.data.TensorDataset(*d) for d in data]
    general = train_fused(task, model, datasets, contexts(model, len(data), settings))
    assert banked is not None and general is not None
    for one, other in zip(banked, general, strict=True):
        assert one.result == other.result
        for name, tensor in one.weights.items():
            assert torch.equal(tensor, other.weights[name]), name


def test_a_round_planned_in_many_windows_trains_to_the_bits_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large data is planned a window of steps at a time (PLAN_ROWS bank rows), not a round at once."""
    from fedmq.common.task import fused

    task, data = Mlp(), clients()
    model = model_for(task)
    settings = TrainSettings(epochs=3, batch_size=8, optimizer="adam", lr=0.01)
    whole = train_fused(task, model, data, contexts(model, len(data), settings))
    monkeypatch.setattr(fused, "PLAN_ROWS", 8)  # a window a step
    windows = train_fused(task, model, data, contexts(model, len(data), settings))
    assert whole is not None and windows is not None
    for one, other in zip(whole, windows, strict=True):
        assert one.result == other.result
        assert all(torch.equal(t, other.weights[n]) for n, t in one.weights.items())


def test_clients_without_examples_train_nothing_and_say_so() -> None:
    task = Mlp()
    model = model_for(task)
    empty = [(torch.zeros(0, 6), torch.zeros(0, dtype=torch.int64))] * 2
    out = train_fused(task, model, empty, contexts(model, 2, SETTINGS["sgd"]))
    assert out is not None and [o.result.num_examples for o in out] == [0, 0]
    start = dict(model.named_parameters())
    assert all(torch.equal(o.weights[n], start[n].detach()) for o in out for n in o.weights)


class Regressor(Task):
    """A small regressor trained with Adam: the case where a lone client's batched products took
    another kernel than a group's, before a client alone stepped as a group of two."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))

    def load_data(self, ctx: Any) -> ClientData:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def test_a_regressor_alone_trains_to_the_bits_it_gets_in_a_group() -> None:
    task = Regressor()
    torch.manual_seed(0)
    model = task.build_model()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 10, generator=g), torch.randn(n, 1, generator=g)) for n in (71, 71, 70)]
    settings = TrainSettings(epochs=2, batch_size=16, optimizer="adam", lr=0.003, weight_decay=0.05)
    together = train_fused(task, model, data, contexts(model, 3, settings))
    assert together is not None
    for i in range(3):
        alone = train_fused(task, model, [data[i]], [contexts(model, 3, settings)[i]])
        assert alone is not None
        assert all(torch.equal(alone[0].weights[n], together[i].weights[n]) for n in alone[0].weights), i


def test_a_client_whose_weights_went_non_finite_is_the_only_one_not_known_finite() -> None:
    task = Mlp()
    model = model_for(task)
    data = clients([8, 8, 8])
    data[1] = (torch.full_like(data[1][0], float("nan")), data[1][1])
    fused = train_fused(task, model, data, contexts(model, 3, SETTINGS["sgd"]))
    assert fused is not None
    assert [f.finite for f in fused] == [True, False, True]


def test_fused_training_and_its_recordings_leave_torch_dynamo_unimported() -> None:
    # torch.func's grad and a TorchDispatchMode's default wrapping import torch._dynamo (1.7-2.2 s
    # on 2 cores) at their first call: a fresh `fedmq run` paid it in its first round.
    script = """
import sys
import torch
from tests.unit.test_fused import Mlp, SETTINGS, clients, contexts, model_for
from fedmq.common.task.fused import train_fused
from fedmq.common.task.traced import RECORD_AT
task, data = Mlp(), clients()
model = model_for(task)
for _ in range(RECORD_AT + 1):  # decided, run as written, recorded, then replayed
    assert train_fused(task, model, data, contexts(model, len(data), SETTINGS["sgd"])) is not None
print(sorted(name for name in sys.modules if name.startswith("torch._dynamo")))
"""
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
