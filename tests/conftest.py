"""Shared fixtures: small job specs, isolated service settings, the test tiers, weight comparisons."""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings as hypothesis_settings

from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import JobSpec, canonical_json, parse_job
from fedmq.common.settings import Settings
from tests import rabbit
from tests.tiers import mark_tiers

REPO = Path(__file__).resolve().parent.parent

# CI runs the property tests on a fixed sequence of examples, so a build fails for the code it
# builds, never for a new random draw; a developer's runs keep exploring (and keep what they find
# in .hypothesis/).
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")

# DP-SGD jobs (train.dp_sgd) repeat bit for bit only with one learner key: every service and test
# process here shares this one; tests of the default (a random key) pass dp_key=None themselves.
os.environ.setdefault("FEDMQ_DP_KEY", "fedmq-tests-not-a-secret")

# Services against tests/reference.py, which adds in another order (float64 averages, plain SGD
# arithmetic). |a - b| <= ATOL + RTOL * |b|. Measured on SGD jobs of 2-5 rounds like the tests'
# (weights up to 1.0): max |a - b| 4.5e-8 to 1.8e-7, 2-4% of this tolerance. Bugs are far over
# it: one client weighted by n+1 instead of n 460x, a learning rate off by 1e-4 (relative) 6x,
# another shuffle 10000x. Adam amplifies rounding (4 rounds: 1.4e-6, 83% of it) and so do long
# jobs (the 30-round example: 2.7e-5): compare short SGD jobs.
RTOL, ATOL = 1e-5, 1e-6


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_tiers(items)


@pytest.fixture(autouse=True)
def services_train_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """FEDMQ_DEVICE=cpu for every Settings() a test builds and every process it starts.

    Bit-identity between runs and the comparison with tests/reference.py (which trains on the
    CPU) are CPU facts: with the default `auto`, services on a GPU machine train on CUDA and
    differ from the reference in the last bits. A test about devices passes
    `Settings(device=...)` or sets FEDMQ_DEVICE for its process itself.
    """
    monkeypatch.setenv("FEDMQ_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def services_may_import_the_tests_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """FEDMQ_ALLOWED_CODE=tests,examples for every Settings() a test builds and every process it starts.

    Services import a job's code only from fedmq's built-ins and that setting's prefixes; the
    tests' Tasks and strategies live in tests/ and examples/. A test about the allow-list sets
    its own (tests/integration/test_code_allow_list.py).
    """
    monkeypatch.setenv("FEDMQ_ALLOWED_CODE", "tests,examples")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    rabbit.RUNNING[:] = [item]  # so require_rabbitmq can check the test is marked
    try:
        return (yield)
    finally:
        rabbit.RUNNING.clear()


def small_job(**changes: Any) -> JobSpec:
    """A digits job that trains in about a second: 5 clients, 3 rounds, 1 local epoch."""
    raw: dict[str, Any] = {
        "name": "tiny",
        "seed": 3,
        "task": {"name": "digits", "options": {
            "model": {"name": "mlp", "hidden": [32]}, "partition": {"kind": "dirichlet", "alpha": 0.5},
        }},
        "clients": {"total": 5},
        "rounds": 3,
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.1},
        "round_timeout_s": 60,
    }
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return parse_job(raw)


def shard_size(spec: JobSpec, client: int) -> int:
    """How many training examples `client` of the spec's Task holds."""
    from fedmq.common.task.runtime import TaskRuntime

    return len(TaskRuntime.for_job(spec).load_data(client, None).train[1])


def assert_bit_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same names, dtypes, shapes and bytes: equality that NaN or -0.0 cannot fool."""
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


def assert_matches_reference(result: dict[str, Any], expected: dict[str, Any]) -> None:
    """A run's final weights and per-round accuracies against tests/reference.py's, within float error."""
    weights = load_state(result["model_path"])[0]
    assert weights.keys() == expected["weights"].keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected["weights"][name], rtol=RTOL, atol=ATOL, msg=name)
    # Weights a few ulps apart may put a test example either side of a tie: allow one example.
    one_example = 1 / expected["test_examples"]
    accuracies = [h["metrics"]["server"]["accuracy"] for h in result["history"][1:]]
    assert accuracies == pytest.approx(expected["accuracies"], rel=0, abs=one_example)


class EmbeddedRuns:
    """Undisturbed runs of the in-process engine, one per spec per session: every run of the services
    (either bus, any number of learners, kills and redeliveries) must end with their weights."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._weights: dict[str, dict[str, torch.Tensor]] = {}

    def weights(self, spec: JobSpec) -> dict[str, torch.Tensor]:
        """The final weights every other run of `spec` must match bit for bit."""
        from fedmq.services.engine.run import run_job

        key = canonical_json(spec)
        if key not in self._weights:
            state = self.root / f"run-{len(self._weights)}"
            # The thread count a one-learner embedded cluster gives torch here (the same arithmetic).
            threads = max(1, (os.cpu_count() or 1) // 2)
            result = run_job(spec, Settings(state_dir=state, log_format="json", torch_threads=threads))
            assert result["status"] == "completed", result
            self._weights[key] = load_state(result["model_path"])[0]
        return self._weights[key]


@pytest.fixture(scope="session")
def embedded_runs(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedRuns:
    return EmbeddedRuns(tmp_path_factory.mktemp("embedded"))


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(state_dir=tmp_path / "state", log_format="json", log_level="warning")
