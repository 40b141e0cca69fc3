"""Every example workload through the services, from Python (`fedmq.run`), to its acceptance:
regression as good as central training, a GAN better than untrained, a language model better
than unigram frequencies, and seed 002's worker on digits. `tests/e2e/test_cli_run.py` runs them
through `fedmq run`; `tests/integration/test_example_reproducibility.py` across buses."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import fedmq
from fedmq.common.jobspec import JobSpec, load_job
from fedmq.common.task.runtime import TaskRuntime
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # whole example jobs: tens of seconds each


def example(name: str, **changes: object) -> JobSpec:
    return load_job(REPO / "examples" / f"{name}.yaml").with_changes(**changes)


def test_federated_regression_is_as_good_as_training_on_the_pooled_data(tmp_path: Path) -> None:
    federated = fedmq.run(example("regression"), state_dir=tmp_path / "fl")
    pooled = fedmq.run(
        example("regression", clients={"total": 1, "per_round": 1, "min_fit": 1}),
        state_dir=tmp_path / "central",
    )
    assert federated.ok and pooled.ok
    r2, central = federated.final.get("server.r2"), pooled.final.get("server.r2")  # type: ignore[union-attr]
    assert r2 is not None and central is not None
    assert abs(r2 - central) < 0.05, (r2, central)
    assert r2 > 0.3  # and it learned something: a constant predictor scores 0
    assert {"mse", "mae", "r2"} <= set(federated.history[-1].metrics["server"])
    assert federated.best is not None and federated.spec.objective is not None
    assert federated.spec.objective.metric == "server.mse" and federated.spec.objective.mode == "min"


def test_the_federated_gan_draws_digits_closer_to_real_ones_than_an_untrained_one(tmp_path: Path) -> None:
    result = fedmq.run(example("gan"), state_dir=tmp_path)
    assert result.ok
    untrained, trained = result.history[0].get("server.mmd"), result.final.get("server.mmd")  # type: ignore[union-attr]
    assert untrained is not None and trained is not None
    # The documented measure (examples/gan.py): unbiased MMD² against held-out real digits.
    assert trained < untrained / 4, (untrained, trained)
    assert {"g_loss", "d_loss"} <= set(result.history[-1].metrics["train"])
    assert result.model_path is not None
    png = Path(result.model_path).parent / "artifacts" / "samples.png"  # beside the job's model
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_character_model_beats_unigram_frequencies(tmp_path: Path) -> None:
    from examples import charlm

    spec = example("charlm")
    result = fedmq.run(spec, state_dir=tmp_path)
    assert result.ok
    task = TaskRuntime.for_job(spec).task
    assert isinstance(task, charlm.CharLM)
    unigram = charlm.baseline(task, spec.seed, spec.clients.total)
    perplexity = result.final.get("server.perplexity")  # type: ignore[union-attr]
    assert perplexity is not None and perplexity < unigram, (perplexity, unigram)
    assert result.final.get("federated.perplexity") is not None  # type: ignore[union-attr]


def test_the_python_api_example_runs_and_hands_back_the_best_model(tmp_path: Path, monkeypatch) -> None:
    from examples import python_api

    monkeypatch.chdir(tmp_path)
    result = python_api.main()
    assert result.ok and result.best is not None
    assert [r for r, _ in result.metric("federated.accuracy")] == [5, 10, 15]
    assert result.sync_stats.bytes_sent > 0 and result.sync_stats.train_seconds > 0


def test_seed_002_workers_train_digits_in_twenty_lines_of_their_code(tmp_path: Path, monkeypatch) -> None:
    from examples import seed002_worker

    monkeypatch.chdir(tmp_path)
    result = seed002_worker.main()
    assert result.ok
    accuracy = result.final.get("server.accuracy")  # type: ignore[union-attr]
    assert accuracy is not None and accuracy >= 0.92, accuracy
    assert user_lines(REPO / "examples" / "seed002_worker.py", ("DigitsTrainer", "main")) <= 20


def user_lines(path: Path, names: tuple[str, ...]) -> int:
    """Lines of code (no blank, comment or docstring lines) of the named top-level definitions:
    what a seed-002 user writes to make their worker a fedmq job (the worker itself is theirs)."""
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    count = 0
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name in names:
            docstrings = {
                n.body[0].lineno
                for n in ast.walk(node)
                if isinstance(n, ast.ClassDef | ast.FunctionDef)
                and n.body
                and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)
            }
            for number in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                text = lines[number - 1].strip()
                if text and not text.startswith("#") and number not in docstrings:
                    count += 1
    return count


def test_the_synthetic_task_makes_any_clients_data_from_its_id_and_learns(tmp_path: Path) -> None:
    spec = example("synthetic", clients={"total": 50_000, "per_round": 50, "min_fit": 50}, rounds=4)
    task = TaskRuntime.for_job(spec)
    first, again, other = (task.load_data(c, None).train for c in (49_999, 49_999, 7))
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], other[0])
    result = fedmq.run(spec, state_dir=tmp_path)
    assert result.ok
    before, after = result.history[0].get("server.loss"), result.final.get("server.loss")  # type: ignore[union-attr]
    assert before is not None and after is not None and after < before / 2, (before, after)
