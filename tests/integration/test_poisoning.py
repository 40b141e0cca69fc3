"""Poisoning: 3 of 10 clients send sign-flipped or 100x scaled updates (tests/support/poisoning.py).

FedAvg collapses, which shows the attacks work; median, trimmed mean and Multi-Krum finish
within 3 accuracy points of the clean FedAvg run measured here, on the in-memory bus.

Krum falls short of that target, attack or not: it keeps one client's weights each round,
and a model fitted last on one client's ~144 digits plateaus about 5 points under FedAvg's
mean of ten (measured, clean and IID: 89% against 93% here, 90% against 95% at 30 rounds,
with 1 or 3 epochs, batch 32 or 144, learning rate 0.1 to 0.5). What the test shows for
Krum is that the attacks do not move it: under each it finishes within 3 points of its own
clean run.

Bulyan needs k >= 4f + 3 clients to tolerate f, so 3 poisoned of 10 is beyond it (at most
f=1 for 10). It gets the same 3 poisoned clients among 15 with f=3, against a clean FedAvg
run of those 15: no Bulyan setting tolerates 30% of the clients.

The data is split IID. Krum keeps a single client's weights each round, so on label-skewed
clients it is far below FedAvg even with no attack (examples/digits.yaml's Dirichlet 0.5
split: about 84% against 97%); the robust rules assume honest clients that roughly agree.
One local epoch keeps each client's weights near the global ones. 20 rounds: clean FedAvg
is past 90% by then, and the 15 runs take about half a minute on 2 cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedmq.common.jobspec import JobSpec, parse_job
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job

pytestmark = pytest.mark.slow

ATTACKERS = 3
ATTACKS = {"sign_flip": 4.0, "scale": 100.0}  # the factor: w_g - 4(w - w_g), w_g + 100(w - w_g)
ROBUST: dict[str, dict[str, Any]] = {"median": {}, "trimmed_mean": {"beta": 0.3}, "multi_krum": {"f": 3}}
KRUM = {"f": ATTACKERS}
BULYAN = {"f": ATTACKERS}
BULYAN_CLIENTS = 4 * ATTACKERS + 3
TOLERANCE = 0.03  # accuracy a robust rule may lose under attack against clean FedAvg
COLLAPSE = 0.5  # accuracy FedAvg loses under attack, at least: it is left near chance
ROUNDS = 20


def poisoning_job(strategy: dict[str, Any], attack: str, clients: int) -> JobSpec:
    return parse_job({
        "name": f"poison-{strategy['name']}-{attack}",
        "seed": 0,
        "task": {"name": "tests.support.poisoning:PoisonedDigits", "options": {
            "model": {"name": "mlp", "hidden": [128]},
            "partition": {"kind": "iid"},
            "attack": attack, "attackers": ATTACKERS, "factor": ATTACKS.get(attack, 1.0),
        }},
        "clients": {"total": clients},
        "rounds": ROUNDS,
        "train": {"epochs": 1, "batch_size": 32, "optimizer": "sgd", "lr": 0.1},
        "strategy": strategy,
        "round_timeout_s": 120,
    })


class Runs:
    """Each (strategy, attack, clients) job run once for the module; its per-round server accuracy."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.results: dict[tuple[str, str, int], dict[str, Any]] = {}

    def run(self, name: str, options: dict[str, Any], attack: str, clients: int = 10) -> dict[str, Any]:
        key = (name, attack, clients)
        if key not in self.results:
            spec = poisoning_job({"name": name, "options": options}, attack, clients)
            settings = Settings(state_dir=self.root / "-".join(map(str, key)), log_level="warning")
            self.results[key] = run_job(spec, settings, idle_timeout=60)
        return self.results[key]

    def clean(self, clients: int = 10) -> float:
        result = self.run("fedavg", {}, "none", clients)
        assert result["status"] == "completed", result.get("reason")
        return accuracies(result)[-1]


def accuracies(result: dict[str, Any]) -> list[float]:
    """The server's accuracy after each round that closed (round 0: the initial model)."""
    return [h["metrics"]["server"]["accuracy"] for h in result["history"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("poisoning"))


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_fedavg_collapses_when_3_of_10_clients_poison_their_updates(runs: Runs, attack: str) -> None:
    clean = runs.clean()
    result = runs.run("fedavg", {}, attack)
    # A scaled attack may blow the model up until its loss is no longer finite: the job then
    # fails saying so, and that is a collapse too. Either way the last model is near chance.
    assert result["status"] == "completed" or "not finite" in result.get("reason", ""), result.get("reason")
    last = accuracies(result)[-1]
    assert last < clean - COLLAPSE, f"FedAvg under {attack}: {last:.3f}, clean {clean:.3f}"


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("name", list(ROBUST))
def test_a_robust_strategy_finishes_within_3_points_of_clean_fedavg_under_attack(
    runs: Runs, name: str, attack: str
) -> None:
    clean = runs.clean()
    result = runs.run(name, ROBUST[name], attack)
    assert result["status"] == "completed", result.get("reason")
    final = accuracies(result)[-1]
    assert final >= clean - TOLERANCE, f"{name} under {attack}: {final:.3f}, clean FedAvg {clean:.3f}"
    metrics = result["history"][-1]["metrics"]["strategy"]
    assert metrics["selected"] == (10 - ATTACKERS if name == "multi_krum" else 10)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_krum_finishes_within_3_points_of_its_own_clean_run_under_attack(runs: Runs, attack: str) -> None:
    clean = runs.run("krum", KRUM, "none")
    result = runs.run("krum", KRUM, attack)
    assert clean["status"] == result["status"] == "completed", (clean.get("reason"), result.get("reason"))
    final, reference = accuracies(result)[-1], accuracies(clean)[-1]
    assert final >= reference - TOLERANCE, f"krum under {attack}: {final:.3f}, clean krum {reference:.3f}"
    assert result["history"][-1]["metrics"]["strategy"] == {"selected": 1, "dropped": 9}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_bulyan_finishes_within_3_points_of_clean_fedavg_with_3_of_15_clients_poisoning(
    runs: Runs, attack: str
) -> None:
    clean = runs.clean(BULYAN_CLIENTS)
    result = runs.run("bulyan", BULYAN, attack, BULYAN_CLIENTS)
    assert result["status"] == "completed", result.get("reason")
    final = accuracies(result)[-1]
    assert final >= clean - TOLERANCE, f"bulyan under {attack}: {final:.3f}, clean FedAvg {clean:.3f}"
    assert result["history"][-1]["metrics"]["strategy"] == {
        "selected": BULYAN_CLIENTS - 2 * ATTACKERS, "dropped": 2 * ATTACKERS}
