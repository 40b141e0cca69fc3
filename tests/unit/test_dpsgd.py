"""Local DP-SGD (`train.dp_sgd`) against an independent per-example loop, and its privacy account.

The oracle computes each example's gradient with plain autograd on a batch of one, one example at
a time, clips and sums them by hand: nothing of torch.func or fedmq's arithmetic. Opacus's own
RDPAccountant, stepped once per DP-SGD step, is the oracle for ε.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import nn

from fedmq.common.errors import ConfigError
from fedmq.common.task.contract import DpSgd, TrainContext, TrainSettings
from fedmq.common.task.dpsgd import EPSILON, PrivateGradients, epsilon_spent
from fedmq.common.task.fused import group_size, train_fused
from fedmq.common.task.loop import train_with_loss
from tests.unit.test_fused import Mlp, clients, contexts, model_for

TOLERANCE = 1e-5


def oracle_gradient(
    task: Mlp, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], clip: float, batch_size: int
) -> dict[str, torch.Tensor]:
    """Σ_i clip(∇ loss(example i)) / B (the job's batch size), one example at a time with autograd."""
    x, y = batch
    params = dict(model.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(len(x)):
        loss, _ = task.loss(model, (x[i : i + 1], y[i : i + 1]))
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        factor = min(1.0, clip / (norm + 1e-6))
        for n, g in grads.items():
            total[n] += g * factor
    return {n: t / batch_size for n, t in total.items()}


def grad_of(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad.clone()


def dp_context(
    model: nn.Module, dp: DpSgd, *, round_: int = 1, client: int = 0, **train: Any
) -> TrainContext:
    settings = TrainSettings(**{"epochs": 1, "batch_size": 8, "lr": 0.1, **train}, dp_sgd=dp)
    return TrainContext(client=client, round=round_, seed=5, train=settings, device=torch.device("cpu"),
                        generator=torch.Generator().manual_seed(100 + client),
                        global_weights={n: p.detach().clone() for n, p in model.named_parameters()},
                        private_seed=secret(round_, client))


def secret(round_: int, client: int) -> int:
    return 7_000 + 100 * round_ + client


def private(ctxs: list[TrainContext]) -> list[TrainContext]:
    """The contexts a learner would give: each with its secret seed."""
    return [dataclasses.replace(ctx, private_seed=secret(ctx.round, ctx.client)) for ctx in ctxs]


@pytest.mark.parametrize("summed", [False, True], ids=["mean-loss", "sum-loss"])
@pytest.mark.parametrize("clip", [0.05, 100.0], ids=["clipping", "no-clipping"])
def test_a_private_gradient_without_noise_is_the_mean_of_clipped_per_example_gradients(
    summed: bool, clip: float
) -> None:
    task = Mlp(summed=summed)
    model = model_for(task)
    x, y = clients([12])[0]
    ctx = dp_context(model, DpSgd(clip_norm=clip, noise_multiplier=0.0))
    loss, metrics = PrivateGradients(task, model, ctx).backward((x, y))
    got = {n: grad_of(p) for n, p in model.named_parameters()}
    want = oracle_gradient(task, model, (x, y), clip, 8)
    for n in want:
        assert torch.allclose(got[n], want[n], atol=1e-7, rtol=1e-5), n
    each = [float(task.loss(model, (x[i : i + 1], y[i : i + 1]))[0].detach()) for i in range(len(x))]
    assert float(loss) == pytest.approx(sum(each) / len(each), rel=1e-5)
    assert set(metrics) == {"accuracy"}


def test_the_noise_has_the_spec_s_standard_deviation_and_is_seeded_per_round_and_client() -> None:
    model = nn.Linear(100, 300)  # 30,300 coordinates: the sample std is within 2% of the truth
    task = Mlp()
    task.build_model = lambda: model  # type: ignore[method-assign]
    x, y = torch.randn(4, 100), torch.randint(0, 3, (4,))
    dp = DpSgd(clip_norm=0.5, noise_multiplier=2.0)
    clipped = oracle_gradient(task, model, (x, y), dp.clip_norm, 8)

    def noise(round_: int, client: int) -> torch.Tensor:
        ctx = dp_context(model, dp, round_=round_, client=client)
        PrivateGradients(task, model, ctx).backward((x, y))
        return torch.cat([(grad_of(p) - clipped[n]).flatten() * 8 for n, p in model.named_parameters()])

    first = noise(1, 0)
    assert float(first.std()) == pytest.approx(dp.noise_multiplier * dp.clip_norm, rel=0.02)
    assert abs(float(first.mean())) < 0.02
    assert torch.allclose(noise(1, 0), first, atol=1e-6), "the same round and client draw the same noise"
    assert not torch.allclose(noise(2, 0), first, atol=1e-3), "another round draws other noise"
    assert not torch.allclose(noise(1, 1), first, atol=1e-3), "another client draws other noise"


def test_the_loop_trains_with_dp_sgd_as_a_hand_written_dp_sgd_without_noise() -> None:
    task = Mlp()
    model = model_for(task)
    x, y = clients([21])[0]
    ctx = dp_context(model, DpSgd(clip_norm=0.3, noise_multiplier=0.0), epochs=2)
    reference = model_for(task)
    order = torch.Generator().manual_seed(100)  # the client's stream, as the context's
    train_with_loss(task, model, (x, y), ctx)
    for _ in range(2):
        perm = torch.randperm(len(x), generator=order)
        for start in range(0, len(x), 8):
            idx = perm[start : start + 8]
            grads = oracle_gradient(task, reference, (x[idx], y[idx]), 0.3, 8)
            with torch.no_grad():
                for n, p in reference.named_parameters():
                    p.sub_(0.1 * grads[n])
    for (n, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), n


def test_training_with_noise_is_bit_identical_when_run_again_and_reports_epsilon() -> None:
    task, data = Mlp(dropout=0.3), clients([30])[0]  # dropout: a mask per example, seeded
    dp = DpSgd(clip_norm=1.0, noise_multiplier=1.1, delta=1e-5)
    runs = []
    for _ in range(2):
        model = model_for(task)
        torch.manual_seed(7)
        result = train_with_loss(task, model, data, dp_context(model, dp, round_=3, epochs=2))
        runs.append(([p.detach().clone() for p in model.parameters()], result))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))
    assert runs[0][1] == runs[1][1]
    steps = 2 * math.ceil(30 / 8)
    assert runs[0][1].metrics[EPSILON] == pytest.approx(opacus_epsilon(1.1, 8 / 30, steps * 3, 1e-5))


def opacus_epsilon(noise: float, rate: float, steps: int, delta: float) -> float:
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=noise, sample_rate=rate)
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize(("examples", "steps", "rounds"), [(40, 5, 1), (200, 7, 12), (9, 2, 30)])
def test_epsilon_is_opacus_s_account_of_every_step_of_every_round_so_far(
    examples: int, steps: int, rounds: int
) -> None:
    dp = DpSgd(clip_norm=1.0, noise_multiplier=0.9, delta=1e-6)
    got = epsilon_spent(dp, 8, examples, steps, rounds)[EPSILON]
    assert got == pytest.approx(opacus_epsilon(0.9, min(1.0, 8 / examples), steps * rounds, 1e-6), rel=1e-9)
    assert epsilon_spent(DpSgd(clip_norm=1.0, noise_multiplier=0.0), 8, examples, steps, rounds) == {}, (
        "no noise: no finite epsilon to report"
    )


SETTINGS: dict[str, dict[str, Any]] = {
    "sgd": {"epochs": 2, "batch_size": 8, "lr": 0.1},
    "sgd-momentum": {"epochs": 2, "batch_size": 8, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
    "adam": {"epochs": 2, "batch_size": 8, "optimizer": "adam", "lr": 0.01},
}


@pytest.mark.parametrize(("name", "proximal"), [("sgd", 0.0), ("sgd-momentum", 0.5), ("adam", 0.5)],
                         ids=["sgd", "sgd-momentum-fedprox", "adam-fedprox"])
def test_fused_dp_sgd_lands_within_tolerance_of_the_sequential_loop_noise_and_all(
    name: str, proximal: float
) -> None:
    task, data = Mlp(), clients()
    model = model_for(task)
    settings = TrainSettings(**SETTINGS[name], dp_sgd=DpSgd(clip_norm=0.5, noise_multiplier=0.8))
    config = {"proximal_mu": proximal} if proximal else {}
    fused = train_fused(task, model, data, private(contexts(model, len(data), settings, config)))
    assert fused is not None, "DP-SGD fuses"
    start = {n: p.detach().clone() for n, p in model.state_dict().items()}
    for i, (ctx, batch) in enumerate(zip(private(contexts(model, len(data), settings, config)), data,
                                         strict=True)):
        one = model_for(task)
        one.load_state_dict(start)
        result = train_with_loss(task, one, batch, ctx)
        gap = max(float((fused[i].weights[n] - p.detach()).abs().max()) for n, p in one.named_parameters())
        assert gap < TOLERANCE, f"client {i}: fused is {gap:.2e} from sequential"
        assert set(fused[i].result.metrics) == {"loss", "accuracy", EPSILON}
        for metric, value in result.metrics.items():
            assert fused[i].result.metrics[metric] == pytest.approx(value, abs=1e-5), metric


def test_a_model_with_batchnorm_is_refused_with_what_to_use_instead() -> None:
    task = Mlp(norm=True)
    model = model_for(task)
    with pytest.raises(TypeError, match="BatchNorm1d, which mixes a batch's examples: use GroupNorm"):
        ctx = dp_context(model, DpSgd(clip_norm=1, noise_multiplier=1))
        train_with_loss(task, model, clients([8])[0], ctx)


def test_a_dataloader_is_refused_because_its_sampling_rate_is_unknown() -> None:
    task = Mlp()
    model = model_for(task)
    x, y = clients([8])[0]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    with pytest.raises(TypeError, match="sampling rate is unknown"):
        train_with_loss(task, model, loader, dp_context(model, DpSgd(clip_norm=1, noise_multiplier=1)))


def test_the_fused_group_size_counts_a_gradient_per_example() -> None:
    model = model_for(Mlp())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    plain = TrainSettings(batch_size=8)
    dp = TrainSettings(batch_size=8, dp_sgd=DpSgd(clip_norm=1, noise_multiplier=1))
    assert group_size(model, plain, weights * 2 * 10) == 10
    assert group_size(model, dp, weights * (2 + 9) * 10) == 10
    assert group_size(model, dp, weights * 2 * 10) == 1


def test_dp_sgd_without_a_secret_seed_is_refused_rather_than_noised_from_the_public_seed() -> None:
    task = Mlp()
    model = model_for(task)
    ctx = dataclasses.replace(dp_context(model, DpSgd(clip_norm=1, noise_multiplier=1)), private_seed=None)
    with pytest.raises(ConfigError, match="needs the context's private_seed"):
        train_with_loss(task, model, clients([8])[0], ctx)
