"""The example Tasks (examples/*.py) against the contract: each builds, loads a client, trains one
client and evaluates; their baselines and measures compute what their docstrings say."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest
import torch

import fedmq
from examples import charlm, gan, regression
from examples.plugins.my_task import MyTask
from fedmq.common.jobspec import JobSpec, load_job
from fedmq.common.seeding import torch_generator
from fedmq.common.task.metrics import reduce_metrics
from fedmq.common.task.runtime import TaskRuntime
from tests.support.simulate import centralised, settings, simulate, with_changes

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def example(name: str, **changes: Any) -> JobSpec:
    return with_changes(load_job(REPO / "examples" / f"{name}.yaml"), **changes)


def train_one(rt: TaskRuntime, client: int = 0) -> tuple[torch.nn.Module, fedmq.TrainResult]:
    """One client's round 1 from the initial model, as a learner would run it."""
    model = rt.build_model()
    ctx = fedmq.TrainContext(
        client=client,
        round=1,
        seed=rt.spec.seed,
        train=settings(rt.spec),
        device=CPU,
        generator=torch_generator(rt.spec.seed, "train", 1, client),
        global_weights={k: v.clone() for k, v in model.state_dict().items()},
    )
    return model, rt.train(model, rt.load_data(client, None), ctx)


def server_eval(rt: TaskRuntime, model: torch.nn.Module) -> fedmq.EvalResult:
    ctx = fedmq.EvalContext(round=1, seed=rt.spec.seed, device=CPU)
    return rt.evaluate(model, rt.load_server_data(None), ctx)


def test_every_example_spec_names_its_task_and_objective() -> None:
    objectives = {"regression": "server.mse", "gan": "server.mmd", "charlm": "server.perplexity"}
    for name, metric in objectives.items():
        spec = example(name)
        assert spec.objective is not None and spec.objective.metric == metric
        TaskRuntime.for_job(spec)  # the Task imports and its options validate


# -- regression ---------------------------------------------------------------------------------


def test_regression_trains_a_client_and_reports_mse_mae_r2() -> None:
    rt = TaskRuntime.for_job(example("regression"))
    data = rt.load_data(0, None)
    x, y = data.train
    assert x.dtype == y.dtype == torch.float32 and x.shape[1] == 10 and y.shape[1] == 1
    model, result = train_one(rt)
    assert result.num_examples == len(y)  # fedmq's loop counts the last epoch's examples
    assert set(result.metrics) == {"loss"}
    evaluated = server_eval(rt, model)
    assert set(evaluated.metrics) == {"mse", "mae", "r2"} and evaluated.num_examples == 88


def test_regression_r2_is_over_the_whole_split_as_scikit_learn_computes_it() -> None:
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    rng = np.random.default_rng(0)
    target = rng.normal(150, 70, size=(50, 1))
    predicted = target + rng.normal(0, 40, size=(50, 1))
    got = regression.regression_metrics(torch.from_numpy(predicted), torch.from_numpy(target))
    assert got["r2"] == pytest.approx(r2_score(target, predicted), rel=1e-9)
    assert got["mse"] == pytest.approx(mean_squared_error(target, predicted), rel=1e-9)
    assert got["mae"] == pytest.approx(mean_absolute_error(target, predicted), rel=1e-9)


def test_regression_clients_partition_the_training_split_and_the_central_job_pools_it() -> None:
    spec = example("regression")
    rt = TaskRuntime.for_job(spec)
    sizes = [len(rt.load_data(c, None).train[0]) for c in range(spec.clients.total)]
    pooled = TaskRuntime.for_job(centralised(spec)).load_data(0, None).train[0]
    assert sum(sizes) == len(pooled) == 442 - 88


# -- GAN ------------------------------------------------------------------------------------------


def test_gan_keeps_both_networks_in_one_state_dict_and_trains_both() -> None:
    rt = TaskRuntime.for_job(example("gan"))
    before = {k: v.clone() for k, v in rt.build_model().state_dict().items()}
    assert {k.split(".")[0] for k in before} == {"generator", "discriminator"}
    model, result = train_one(rt)
    assert set(result.metrics) == {"g_loss", "d_loss"} and result.num_examples > 0
    after = model.state_dict()
    for half in ("generator", "discriminator"):
        assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(half))
    assert set(server_eval(rt, model).metrics) == {"mmd", "nn_distance"}


def test_gan_measure_tells_real_digits_from_an_untrained_generator() -> None:
    rt = TaskRuntime.for_job(example("gan"))
    real = rt.load_server_data(None)
    assert isinstance(real, torch.Tensor)
    other_real = (rt.load_data(0, None).train[: len(real)] + 1) / 2
    untrained = server_eval(rt, rt.build_model()).metrics
    alike = gan.sample_quality(other_real, real)
    assert abs(alike["mmd"]) < 0.01 < 0.3 < untrained["mmd"]
    assert alike["nn_distance"] < untrained["nn_distance"]


def test_gan_png_is_written_and_shows_a_grid_of_images(tmp_path: Path) -> None:
    rt = TaskRuntime.for_job(example("gan"))
    model, _ = train_one(rt)
    path = gan.write_samples(model, tmp_path / "grid.png", rows=4, scale=2)
    pixels = (matplotlib.image.imread(path)[..., 0] * 255).round()  # RGBA floats in [0, 1]
    assert pixels.shape == (4 * 10 * 2, 4 * 10 * 2)
    assert pixels.min() < 128 < 250 < pixels.max() and pixels.std() > 10  # ink on paper, not blank
    rt.export(model, tmp_path / "artifacts", 40)
    assert (tmp_path / "artifacts" / "samples.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- character LM ---------------------------------------------------------------------------------


def test_charlm_clients_are_distinct_stdlib_modules_and_the_server_holds_others() -> None:
    spec = example("charlm")
    task = TaskRuntime.for_job(spec).task
    assert isinstance(task, charlm.CharLM)
    server = fedmq.DataContext(-1, spec.clients.total, spec.seed)
    clients, held_out = charlm.choose_modules(task.options, server)
    assert len(set(clients)) == spec.clients.total and not set(clients) & set(held_out)
    again = charlm.choose_modules(task.options, fedmq.DataContext(3, spec.clients.total, spec.seed))
    assert again == (clients, held_out)  # the seed's choice, whoever asks


def test_charlm_trains_a_client_and_reports_perplexity_per_character() -> None:
    rt = TaskRuntime.for_job(example("charlm", train={"max_steps": 2}))
    data = rt.load_data(0, None)
    assert data.train.dtype == torch.int64 and data.train.shape[1] == 65
    model, result = train_one(rt)
    assert result.num_examples == 64  # two batches of 32 windows
    val = rt.evaluate(model, data.val, fedmq.EvalContext(round=1, seed=0, device=CPU, client=0))
    assert val.num_examples == data.val[:, 1:].numel()
    assert val.metrics["perplexity"] == pytest.approx(math.exp(val.metrics["loss"]))


def test_charlm_perplexity_combines_over_clients_into_the_perplexity_of_their_union() -> None:
    rt = TaskRuntime.for_job(example("charlm"))
    model = rt.build_model()
    parts = [rt.load_data(c, None).val for c in (0, 1)]
    ctx = fedmq.EvalContext(round=0, seed=0, device=CPU)
    each = [rt.evaluate(model, part, ctx) for part in parts]
    combined = reduce_metrics([(r.num_examples, r.metrics) for r in each], rt.reductions)
    union = rt.evaluate(model, torch.cat(parts), ctx).metrics
    # Exact in arithmetic; float32 logits batched differently leave ~1e-7.
    assert combined["perplexity"] == pytest.approx(union["perplexity"], rel=1e-6)
    assert combined["loss"] == pytest.approx(union["loss"], rel=1e-6)


def test_the_unigram_baseline_is_the_frequency_models_perplexity() -> None:
    # Predicted training characters "aab" (after the window's first): a=2+1, b=1+1 of VOCAB + 3.
    train = [charlm.windows(charlm.encode(b"xaab"), 3)]
    test = charlm.windows(charlm.encode(b"xab"), 2)
    p_a, p_b = 3 / (charlm.VOCAB + 3), 2 / (charlm.VOCAB + 3)
    expected = math.exp(-(math.log(p_a) + math.log(p_b)) / 2)
    assert charlm.unigram_perplexity(train, test) == pytest.approx(expected)
    spec = example("charlm")
    task = TaskRuntime.for_job(spec).task
    assert isinstance(task, charlm.CharLM)
    assert 10 < charlm.baseline(task, spec.seed, spec.clients.total) < 40  # Python source, by character


# -- the custom Task, and the harness that tunes them ------------------------------------------


def test_my_task_trains_with_its_own_loop_and_the_harness_runs_it() -> None:
    spec = with_changes(
        example("regression"),
        name="blobs",
        task={"name": "examples.plugins.my_task:MyTask", "options": {"width": 8}},
        clients={"total": 3, "per_round": 2},
        rounds=2,
        train={"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0, "options": {"label_smoothing": 0.1}},
        evaluate={"federated": {"clients": 2}},
        objective=None,
    )
    rt = TaskRuntime.for_job(spec)
    assert isinstance(rt.task, MyTask)
    _, result = train_one(rt)
    assert result.num_examples == 2 * 120 and set(result.metrics) == {"loss"}
    run = simulate(spec)
    assert len(run.history) == 3 and "train" not in run.history[0]
    assert set(run.final) == {"train", "server", "federated"}
    assert set(run.final["server"]) == {"loss", "accuracy"}
