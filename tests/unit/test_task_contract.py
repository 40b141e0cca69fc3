"""The Task contract as fedmq uses it: batching, the loss-level loop, metric checks and reduction,
loading Tasks by name, and the errors a misbehaving Task gets."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fedmq
from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import parse_job
from fedmq.common.refs import ref_of
from fedmq.common.seeding import torch_generator
from fedmq.common.task.batches import DataError, source
from fedmq.common.task.loading import make_task, task_class
from fedmq.common.task.metrics import MetricError, check_metrics, reduce_metrics
from fedmq.common.task.runtime import TaskRuntime
from fedmq.common.usercode import UserCodeError

CPU = torch.device("cpu")


class Line(fedmq.Task):
    """y = 2x + 1 with a one-weight linear model: small enough to check by hand."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def load_data(self, ctx: fedmq.DataContext) -> fedmq.ClientData:
        x = torch.linspace(-1, 1, self.n).reshape(-1, 1) + ctx.client
        return fedmq.ClientData(train=(x, 2 * x + 1), val=(x, 2 * x + 1))

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        x, y = batch
        err = model(x) - y
        return err.pow(2).mean(), {"mae": err.abs().mean()}


def runtime(task: str | dict[str, Any] = "tests.unit.test_task_contract:Line", **changes: Any) -> TaskRuntime:
    raw: dict[str, Any] = {
        "name": "t",
        "seed": 1,
        "task": task,
        "clients": {"total": 4},
        "rounds": 2,
        "train": {"epochs": 3, "batch_size": 3, "lr": 0.1},
    }
    raw.update(changes)
    return TaskRuntime.for_job(parse_job(raw))


def train_ctx(rt: TaskRuntime, client: int = 0, **config: Any) -> fedmq.TrainContext:
    t = rt.spec.train
    return fedmq.TrainContext(
        client=client,
        round=1,
        seed=rt.spec.seed,
        device=CPU,
        train=fedmq.TrainSettings(epochs=t.epochs, batch_size=t.batch_size, max_steps=t.max_steps, lr=t.lr),
        generator=torch_generator(rt.spec.seed, "train", 1, client),
        global_weights={},
        config=config,
    )


def test_tensors_dicts_datasets_and_loaders_all_batch() -> None:
    x, y = torch.arange(10.0).reshape(-1, 1), torch.arange(10)
    g = torch.Generator().manual_seed(0)
    for data in ((x, y), {"x": x, "y": y}, TensorDataset(x, y)):
        batches = list(source(data).batches(4, g))
        assert [len(b[0] if not isinstance(b, dict) else b["x"]) for b in batches] == [4, 4, 2]
    loader = source(DataLoader(TensorDataset(x, y), batch_size=5))
    assert not loader.indexable and loader.size == 10 and len(list(loader.batches(4, g))) == 2


def test_data_fedmq_cannot_batch_is_refused_with_what_it_expects() -> None:
    with pytest.raises(DataError, match="share their first dimension"):
        source((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(DataError, match="tuple or dict of tensors"):
        source(42)


def test_the_loop_trains_reproducibly_and_reports_last_epoch_means() -> None:
    rt = runtime()
    a, b = rt.build_model(), rt.build_model()
    assert all(
        torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    data = rt.load_data(2, None)
    first = rt.train(a, data, train_ctx(rt, 2))
    second = rt.train(b, data, train_ctx(rt, 2))
    assert first == second and first.num_examples == 8
    assert set(first.metrics) == {"loss", "mae"}
    assert all(
        torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_max_steps_stops_training_early() -> None:
    rt = runtime(train={"epochs": 5, "batch_size": 2, "lr": 0.1, "max_steps": 3})
    result = rt.train(rt.build_model(), rt.load_data(0, None), train_ctx(rt))
    assert result.num_examples == 6  # three batches of two


def test_the_proximal_term_pulls_weights_towards_the_global_model() -> None:
    rt = runtime()
    data = rt.load_data(0, None)
    start = rt.build_model()
    anchor = {k: v.clone() for k, v in start.state_dict().items()}

    def drift(mu: float) -> float:
        model = rt.build_model()
        ctx = train_ctx(rt, 0, proximal_mu=mu)
        ctx = fedmq.TrainContext(**{**ctx.__dict__, "global_weights": anchor})
        rt.train(model, data, ctx)
        return sum(float((v - anchor[k]).pow(2).sum()) for k, v in model.state_dict().items())

    assert drift(1.0) < drift(0.0)


def test_default_evaluation_is_the_mean_loss_and_metrics_over_the_data() -> None:
    rt = runtime()
    model = rt.build_model()
    x, y = rt.load_data(0, None).val
    result = rt.evaluate(model, (x, y), fedmq.EvalContext(round=0, seed=1, device=CPU, batch_size=3))
    with torch.no_grad():
        err = model(x) - y
    assert result.num_examples == 8
    assert result.metrics["loss"] == pytest.approx(float(err.pow(2).mean()), rel=1e-6)
    assert result.metrics["mae"] == pytest.approx(float(err.abs().mean()), rel=1e-6)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ([1.0], "dict of name"),
        ({"bad name": 1.0}, "must match"),
        ({"x": "high"}, "not a number"),
        ({"x": float("nan")}, "not finite"),
        ({"x": True}, "not a number"),
    ],
)
def test_metrics_must_be_named_finite_numbers(raw: Any, problem: str) -> None:
    with pytest.raises(MetricError, match=problem):
        check_metrics(raw, "m")


def test_tensors_and_numpy_scalars_count_as_numbers() -> None:
    import numpy as np

    assert check_metrics({"a": torch.tensor(0.5), "b": np.float32(2.0), "c": 3}, "m") == {
        "a": 0.5,
        "b": 2.0,
        "c": 3.0,
    }


def test_metrics_combine_weighted_by_examples_or_by_the_tasks_rule() -> None:
    reports = [(10, {"loss": 1.0, "ppl": 2.0, "n": 1.0}), (30, {"loss": 3.0, "ppl": 8.0, "n": 2.0})]
    out = reduce_metrics(reports, {"ppl": "geometric", "n": "sum"})
    assert out["loss"] == pytest.approx(2.5)
    assert out["ppl"] == pytest.approx(math.exp((10 * math.log(2) + 30 * math.log(8)) / 40))
    assert out["n"] == 3.0
    assert reduce_metrics([(5, {"a": 1.0}), (0, {"a": 9.0})], {"a": "max"}) == {"a": 9.0}


def test_tasks_load_by_builtin_name_or_reference() -> None:
    from fedmq.tasks.digits import Digits

    assert task_class("digits") is Digits
    assert task_class("tests.unit.test_task_contract:Line") is Line
    assert ref_of(Line) == "tests.unit.test_task_contract:Line"


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        ("tests.no_such_module_xyz:Task", "no module named"),
        ("no_such_module_xyz:Task", "no module named"),  # in the user's process: a typo, said so
        ("tests.unit.test_task_contract:Nope", "has no attribute"),
        ("tests.unit.test_task_contract:runtime", "not a subclass of fedmq.Task"),
        ("not-a-ref", "built-in name"),
    ],
)
def test_a_task_that_cannot_be_had_is_a_config_error(ref: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        task_class(ref)


def test_bad_options_name_the_option() -> None:
    with pytest.raises(ConfigError, match=r"task\.options\.model\.hidden"):
        make_task("digits", {"model": {"name": "mlp", "hidden": [0]}})
    with pytest.raises(ConfigError, match="unexpected keyword"):
        make_task("tests.unit.test_task_contract:Line", {"m": 3})


class Broken(Line):
    """Each method misbehaves when its option says so."""

    def __init__(self, fail: str = "") -> None:
        super().__init__()
        self.fail = fail

    def build_model(self) -> Any:
        return "not a model" if self.fail == "model" else super().build_model()

    def loss(self, model: nn.Module, batch: Any) -> Any:
        if self.fail == "loss":
            raise ValueError("boom")
        if self.fail == "vector":
            return model(batch[0])
        if self.fail == "nan":
            return super().loss(model, batch)[0], {"m": float("nan")}
        return super().loss(model, batch)

    def evaluate(self, model: nn.Module, data: Any, ctx: fedmq.EvalContext) -> Any:
        return [1.0] if self.fail == "eval" else super().evaluate(model, data, ctx)


@pytest.mark.parametrize(
    ("fail", "method", "message"),
    [
        ("loss", "loss", "ValueError: boom"),
        ("vector", "loss", "scalar tensor"),
        ("nan", "loss", "not finite"),
    ],
)
def test_a_misbehaving_task_is_named_with_its_method_client_and_round(
    fail: str, method: str, message: str
) -> None:
    rt = runtime(task={"name": "tests.unit.test_task_contract:Broken", "options": {"fail": fail}})
    with pytest.raises(UserCodeError) as caught:
        rt.train(rt.build_model(), rt.load_data(1, None), train_ctx(rt, 1))
    assert caught.value.phase == method and caught.value.client == 1 and caught.value.round == 1
    assert message in str(caught.value)


def test_a_model_that_is_not_a_module_and_a_bad_evaluation_are_named() -> None:
    rt = runtime(task={"name": "tests.unit.test_task_contract:Broken", "options": {"fail": "model"}})
    with pytest.raises(UserCodeError, match="build_model raised TypeError: returned a str"):
        rt.build_model()
    rt = runtime(task={"name": "tests.unit.test_task_contract:Broken", "options": {"fail": "eval"}})
    with pytest.raises(UserCodeError, match="evaluate raised TypeError:.*expected a dict of metrics"):
        rt.evaluate(
            rt.build_model(), rt.load_data(0, None).val, fedmq.EvalContext(round=2, seed=1, device=CPU)
        )


def test_importing_fedmq_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, fedmq; assert 'torch' not in sys.modules, 'torch imported'; print(fedmq.Task)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


class OwnLoop(Line):
    """A Task with its own `train` that misbehaves as its option says, and records the model's mode."""

    def __init__(self, fail: str = "") -> None:
        super().__init__()
        self.fail = fail
        self.modes: list[tuple[str, bool]] = []

    def train(self, model: nn.Module, data: Any, ctx: fedmq.TrainContext) -> Any:
        self.modes.append(("train", model.training))
        if self.fail == "dict":
            return {"loss": 1.0}
        if self.fail == "count":
            return fedmq.TrainResult(num_examples=-1)
        with torch.no_grad():
            if self.fail == "nan":
                next(model.parameters()).fill_(float("nan"))
            if self.fail == "shape":
                model.weight = nn.Parameter(torch.zeros(2, 1))
        return fedmq.TrainResult(num_examples=8, metrics={"loss": 0.5})

    def evaluate(self, model: nn.Module, data: Any, ctx: fedmq.EvalContext) -> dict[str, float]:
        self.modes.append(("evaluate", model.training))
        return {"loss": 0.5}


@pytest.mark.parametrize(
    ("fail", "message"),
    [
        ("dict", "returned a dict, expected fedmq.TrainResult"),
        ("count", "num_examples must be a non-negative int"),
        ("shape", "changed names, shapes or dtypes"),
        ("nan", "NaN or infinite values in weight"),
    ],
)
def test_a_train_that_returns_the_wrong_thing_or_breaks_the_model_is_named(fail: str, message: str) -> None:
    rt = runtime(task={"name": "tests.unit.test_task_contract:OwnLoop", "options": {"fail": fail}})
    with pytest.raises(UserCodeError) as caught:
        rt.train(rt.build_model(), rt.load_data(3, None), train_ctx(rt, 3))
    assert caught.value.phase == "train" and caught.value.client == 3 and caught.value.round == 1
    assert message in str(caught.value)


def test_train_always_gets_a_model_in_training_mode_and_evaluate_one_in_eval_mode() -> None:
    rt = runtime(task={"name": "tests.unit.test_task_contract:OwnLoop"})
    task = rt.task
    assert isinstance(task, OwnLoop)
    model, data = rt.build_model(), rt.load_data(0, None)
    model.eval()  # as a learner's shared model is after it evaluated for another client
    rt.train(model, data, train_ctx(rt))
    rt.evaluate(model, data.val, fedmq.EvalContext(round=1, seed=1, device=CPU))
    rt.train(model, data, train_ctx(rt))
    assert task.modes == [("train", True), ("evaluate", False), ("train", True)]


class LeanLine(Line):
    lean_memory = True


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_large_model_steps_in_the_backward_pass_with_the_same_bits(
    optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedmq.common.task import loop, optimizers

    rt = runtime("tests.unit.test_task_contract:LeanLine")
    data = rt.load_data(1, None)
    anchor = {k: v.clone() for k, v in rt.build_model().state_dict().items()}
    used: list[bool] = []
    opened = optimizers._Steps.in_backward

    def counted(self: Any) -> Any:
        used.append(True)
        return opened(self)

    monkeypatch.setattr(optimizers._Steps, "in_backward", counted)

    def trained(threshold: int) -> tuple[fedmq.TrainResult, dict[str, torch.Tensor]]:
        monkeypatch.setattr(loop, "STEP_IN_BACKWARD_BYTES", threshold)
        model = rt.build_model()
        settings = fedmq.TrainSettings(epochs=3, batch_size=3, lr=0.1, optimizer=optimizer,  # type: ignore[arg-type]
                                       momentum=0.5 if optimizer == "sgd" else 0.0, weight_decay=1e-3)
        ctx = train_ctx(rt, 1, proximal_mu=0.3)  # FedProx's term too
        ctx = fedmq.TrainContext(**{**ctx.__dict__, "global_weights": anchor, "train": settings})
        return rt.train(model, data, ctx), model.state_dict()

    plain, plain_weights = trained(1 << 40)
    assert not used
    early, early_weights = trained(0)  # every model counts as large
    assert used == [True]
    assert early == plain
    assert all(torch.equal(plain_weights[k], early_weights[k]) for k in plain_weights)


def test_a_task_that_does_not_promise_lean_memory_steps_after_the_backward_pass(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedmq.common.task import loop, optimizers

    monkeypatch.setattr(loop, "STEP_IN_BACKWARD_BYTES", 0)  # every model counts as large
    monkeypatch.setattr(optimizers._Steps, "in_backward", lambda self: pytest.fail("stepped in backward"))
    rt = runtime()  # Line: lean_memory left False
    assert rt.train(rt.build_model(), rt.load_data(0, None), train_ctx(rt)).num_examples == 8
