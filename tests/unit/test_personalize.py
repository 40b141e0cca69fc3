"""FedPer and Ditto in fedmq's loop, against plain-torch references written from the papers.

FedPer (Arivazhagan et al. 2019): each client trains the global base with its own head; the
server averages the bases only. Ditto (Li et al. 2021): the global model is FedAvg's; each client
also keeps v_k, trained on f_k(v) + λ/2·||v − w^t||² from the round's global model w^t.

Full-batch training (one batch a client and epoch) with plain SGD: the references need no batch
order. They match fedmq's engine within float32 rounding (the loop's batch is a permutation of the
client's examples, summed in another order)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fedmq
from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import JobSpec, parse_job
from fedmq.common.task.runtime import TaskRuntime
from tests.conftest import assert_bit_identical

CLIENTS, ROUNDS, EPOCHS, LR = 4, 3, 2, 0.1
SIZES = [6, 9, 5, 8]


class Tiny(fedmq.Task):
    """A 2-layer regression net on each client's own synthetic data (a shifted target per client)."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        gen = torch.Generator().manual_seed(ctx.client)
        x = torch.randn(SIZES[ctx.client], 3, generator=gen)
        y = torch.stack([x.sum(1), x[:, 0] * (ctx.client - 1.5)], 1)
        return fedmq.ClientData(train=(x, y), val=(x[:3], y[:3]))

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def job(**changes: Any) -> JobSpec:
    return parse_job({
        "name": "personal", "seed": 5, "task": {"name": f"{__name__}:Tiny"},
        "clients": {"total": CLIENTS}, "rounds": ROUNDS,
        "train": {"epochs": EPOCHS, "batch_size": 64, "lr": LR, "fuse": False},
        "evaluate": {"server": False, "federated": {"clients": CLIENTS}}, **changes,
    })


def run(spec: JobSpec, tmp_path: Path) -> fedmq.Result:
    result = fedmq.run(spec, state_dir=tmp_path / str(id(spec)))
    assert result.ok, result.reason
    return result


def sgd(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], anchor: nn.Module | None = None,
        lam: float = 0.0) -> None:
    """EPOCHS full-batch steps of plain SGD on the MSE (+ lam/2·||v − anchor||²)."""
    x, y = data
    for _ in range(EPOCHS):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if anchor is not None:
            loss = loss + lam / 2 * sum(((p - a.detach()) ** 2).sum()
                                        for p, a in zip(model.parameters(), anchor.parameters(), strict=True))
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p.sub_(LR * p.grad)


def initial_and_data(spec: JobSpec) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    runtime = TaskRuntime.for_job(spec)
    return runtime.build_model(), [runtime.load_data(c, None).train for c in range(CLIENTS)]


def mean(models: list[nn.Module]) -> dict[str, torch.Tensor]:
    total = sum(SIZES)
    return {name: sum(m.state_dict()[name] * (n / total) for m, n in zip(models, SIZES, strict=True))
            for name in models[0].state_dict()}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fedper_averages_the_base_and_keeps_each_clients_head_with_it(tmp_path: Path) -> None:
    spec = job(personalize={"method": "fedper", "layers": ["2.*"]})
    glob, data = initial_and_data(spec)
    heads: list[dict[str, torch.Tensor] | None] = [None] * CLIENTS
    initial_head = {k: v.clone() for k, v in glob.state_dict().items() if k.startswith("2.")}
    for _ in range(ROUNDS):
        trained = []
        for c in range(CLIENTS):
            local = copy.deepcopy(glob)
            if (head := heads[c]) is not None:
                local.load_state_dict(head, strict=False)
            sgd(local, data[c])
            heads[c] = {k: v.clone() for k, v in local.state_dict().items() if k.startswith("2.")}
            trained.append(local)
        base = {k: v for k, v in mean(trained).items() if not k.startswith("2.")}
        glob.load_state_dict(base, strict=False)  # the server's head stays where it began
    result = run(spec, tmp_path)
    weights = result.weights("final")
    for name, value in glob.state_dict().items():
        if name.startswith("2."):
            assert torch.equal(weights[name], initial_head[name]), f"the server's {name} moved"
        else:
            assert close(weights[name], value), name
    for c in range(CLIENTS):
        kept = result.client_state(c)
        head = heads[c]
        assert head is not None
        assert set(kept) == {f"personal.{k}" for k in head}
        assert all(close(kept[f"personal.{k}"], v) for k, v in head.items()), c
    last = result.history[-1].metrics
    assert last["personal"]["loss"] < last["federated"]["loss"], "each client's own head fits its data better"


def test_ditto_keeps_fedavgs_global_model_and_trains_each_clients_own_toward_it(tmp_path: Path) -> None:
    lam = 0.5
    spec = job(personalize={"method": "ditto", "lam": lam})
    glob, data = initial_and_data(spec)
    personal: list[nn.Module | None] = [None] * CLIENTS
    for _ in range(ROUNDS):
        trained = []
        for c in range(CLIENTS):
            local = copy.deepcopy(glob)
            sgd(local, data[c])
            trained.append(local)
            mine = personal[c] or copy.deepcopy(glob)
            sgd(mine, data[c], anchor=glob, lam=lam)
            personal[c] = mine
        glob.load_state_dict(mean(trained))
    ours, fedavg = run(spec, tmp_path), run(job(), tmp_path)
    assert_bit_identical(dict(ours.weights("final")), dict(fedavg.weights("final")))
    assert all(close(ours.weights("final")[k], v) for k, v in glob.state_dict().items())
    for c in range(CLIENTS):
        kept, own = ours.client_state(c), personal[c]
        assert own is not None
        assert all(close(kept[f"ditto.{k}"], v) for k, v in own.state_dict().items()), c
    assert ours.metric("federated.loss") == fedavg.metric("federated.loss")
    assert [r for r, _ in ours.metric("personal.loss")] == list(range(1, ROUNDS + 1))


def test_personalize_names_what_is_wrong_before_a_job_runs() -> None:
    with pytest.raises(ConfigError, match="fedper needs layers"):
        job(personalize={"method": "fedper"})
    from fedmq.common.task.contract import Personal
    from fedmq.common.task.layers import own_layers

    model = Tiny().build_model()
    for patterns in (["head.*"], ["*"]):
        with pytest.raises(ValueError, match=r"match \d of the model's 4 parameters"):
            own_layers(model, Personal("fedper", tuple(patterns)))
    with pytest.raises(ConfigError, match="personalize"):
        parse_job({"name": "x", "task": "digits", "clients": {"total": 2}, "rounds": 1,
                   "objective": {"metric": "personal.loss"}})


def test_the_cli_refuses_fedper_layers_that_name_nothing_and_a_task_with_its_own_train() -> None:
    from fedmq.common.allowlist import AllowList
    from fedmq.services.cli.app import check_task

    allowed = AllowList.services(("tests",))
    with pytest.raises(ConfigError, match=r"personalize.layers \['head.\*'\] match 0"):
        check_task(job(personalize={"method": "fedper", "layers": ["head.*"]}), allowed)
    check_task(job(personalize={"method": "fedper", "layers": ["2.*"]}), allowed)
    own_train = job(personalize={"method": "ditto"}).with_changes(
        task={"name": "tests.integration.train_plugins:Slow"})
    with pytest.raises(ConfigError, match="own train\\(\\), and personalize is fedmq's loop's"):
        check_task(own_train, allowed)


def test_personalize_refuses_what_it_cannot_keep_private_or_apart() -> None:
    with pytest.raises(ConfigError, match="ditto with train.dp_sgd"):
        job(personalize={"method": "ditto"}, train={"dp_sgd": {"clip_norm": 1.0, "noise_multiplier": 1.0}})
    with pytest.raises(ConfigError, match="fedper with strategy scaffold"):
        job(personalize={"method": "fedper", "layers": ["2.*"]}, strategy={"name": "scaffold"})
    job(personalize={"method": "fedper", "layers": ["2.*"]}, train={"dp_sgd": {"clip_norm": 1.0,
                                                                                "noise_multiplier": 1.0}})


def test_fedper_keeps_a_heads_buffers_and_no_proximal_term_pulls_its_own_layers() -> None:
    from fedmq.common.task.contract import Personal
    from fedmq.common.task.layers import own_layers, proximal_names
    from fedmq.common.task.personal import personal_model

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.BatchNorm1d(2))
    personal = Personal("fedper", ("1.*", "2.*"))
    assert own_layers(model, personal) == ["1.weight", "1.bias", "2.weight", "2.bias", "2.running_mean",
                                           "2.running_var", "2.num_batches_tracked"]
    assert proximal_names(model, personal) == {"0.weight", "0.bias"}
    assert proximal_names(model, None) == {name for name, _ in model.named_parameters()}
    with pytest.raises(ValueError, match=r"\['head\.\*'\] match nothing"):
        own_layers(model, Personal("fedper", ("1.*", "head.*")))  # one pattern of two a typo
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not personal_model(model, {"ditto.0.weight": torch.zeros(4, 3)}, personal)  # it never trained
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert personal_model(model, {"personal.2.running_mean": torch.ones(2)}, personal)
    assert torch.equal(model.state_dict()["2.running_mean"], torch.ones(2))


def test_a_job_from_the_api_with_fedper_layers_that_name_nothing_fails_saying_so(tmp_path: Path) -> None:
    result = fedmq.run(job(personalize={"method": "fedper", "layers": ["9.*"]}), state_dir=tmp_path)
    assert result.status == "failed" and "['9.*'] match nothing" in result.reason
