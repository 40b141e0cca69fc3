"""The Strategy contract: contexts, results, loading by name or entrypoint, per-client state, checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import fedmq
from fedmq.common.errors import ConfigError, ValidationError
from fedmq.common.jobspec import StrategySpec
from fedmq.common.strategy.checks import check_config, check_tensor_map
from fedmq.common.strategy.clients import SHARED, ClientStore
from fedmq.common.strategy.loading import BUILTIN, make_strategy, strategy_class, strategy_options
from fedmq.common.usercode import UserCodeError
from fedmq.services.aggregator.rounds import check_client_state
from fedmq.services.aggregator.strategies.fedprox import FedProx
from fedmq.services.aggregator.validation import check_extras


class Raising(fedmq.Strategy):
    def __init__(self, options: Any = None) -> None:
        raise RuntimeError("no")

    def aggregate(
        self, ctx: fedmq.RoundContext, current: Mapping[str, torch.Tensor],
        results: Sequence[fedmq.ClientResult], failures: Sequence[fedmq.ClientFailed],
    ) -> fedmq.Aggregate:
        return fedmq.Aggregate(dict(current))


NOT_A_STRATEGY = 3


# --- the contract's types ---------------------------------------------------------------------


def test_a_round_contexts_generator_is_the_same_stream_for_the_same_round_and_keys() -> None:
    ctx = fedmq.RoundContext(round=2, rounds=5, seed=7, num_clients=10)
    same = fedmq.RoundContext(round=2, rounds=5, seed=7, num_clients=10, clients=(1, 2))
    draw = torch.rand(4, generator=ctx.generator("noise"))
    assert torch.equal(draw, torch.rand(4, generator=same.generator("noise")))
    assert not torch.equal(draw, torch.rand(4, generator=ctx.generator("other")))
    later = fedmq.RoundContext(round=3, rounds=5, seed=7, num_clients=10)
    assert not torch.equal(draw, torch.rand(4, generator=later.generator("noise")))


def test_a_round_context_reads_client_state_through_its_reader() -> None:
    ctx = fedmq.RoundContext(round=2, rounds=5, seed=7, num_clients=10,
                             reader=lambda client: {"c": torch.tensor(float(client))})
    assert ctx.client_state(4)["c"].item() == 4.0
    assert fedmq.RoundContext(round=1, rounds=1, seed=0, num_clients=1).client_state(0) == {}


def test_a_client_result_loads_weights_and_extras_only_when_asked() -> None:
    calls: list[str] = []

    def weights() -> dict[str, torch.Tensor]:
        calls.append("weights")
        return {"w": torch.ones(1)}

    result = fedmq.ClientResult(3, 10, {"loss": 0.5}, loader=weights)
    assert calls == []
    assert result.load()["w"].item() == 1.0 and calls == ["weights"]
    assert result.load_extras() == {}


def test_fedprox_configures_every_round_with_its_mu() -> None:
    ctx = fedmq.RoundContext(round=1, rounds=3, seed=0, num_clients=4)
    assert FedProx(FedProx.Options(mu=0.3)).configure(ctx) == {"proximal_mu": 0.3}
    assert fedmq.Strategy.configure(FedProx(), ctx) == {}, "the base configures nothing"


# --- loading ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_built_in_strategy_loads_and_builds_with_default_options(name: str) -> None:
    strategy = make_strategy(StrategySpec(name=name))
    assert isinstance(strategy, strategy_class(name)) and isinstance(strategy, fedmq.Strategy)


def test_an_entrypoint_strategy_is_built_with_its_options_model() -> None:
    strategy = make_strategy(StrategySpec(name="tests.support.strategies:Counting", options={"scale": 2}))
    assert strategy.options.scale == 2.0  # type: ignore[attr-defined]


def test_an_entrypoint_strategys_unknown_option_is_refused_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as caught:
        strategy_options("tests.support.strategies:Counting", {"scael": 2})
    message = str(caught.value)
    assert "strategy 'tests.support.strategies:Counting': invalid options (allowed: scale)" in message
    assert "strategy.options.scael: unknown option; did you mean 'scale'?" in message


def test_a_strategy_taking_no_options_says_so_when_given_one() -> None:
    with pytest.raises(ConfigError, match=r"allowed: none\):\n  - strategy.options.x: unknown option"):
        strategy_options("fedavg", {"x": 1})


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("tests.unit.test_strategy_contract:NOT_A_STRATEGY", "is a int, not a subclass of fedmq.Strategy"),
        ("tests.unit.no_such_module:X", "no module named 'tests.unit.no_such_module'"),
        ("tests.unit.test_strategy_contract:Missing", "has no attribute 'Missing'"),
        ("fedavgg", "unknown strategy 'fedavgg'; did you mean 'fedavg'?"),
    ],
)
def test_a_strategy_that_cannot_be_had_is_a_config_error_saying_why(name: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        strategy_class(name)
    assert expected in str(caught.value)


def test_a_users_strategy_raising_in_its_constructor_is_user_code_naming_the_phase() -> None:
    with pytest.raises(UserCodeError) as caught:
        make_strategy(StrategySpec(name="tests.unit.test_strategy_contract:Raising"))
    assert (caught.value.phase, caught.value.error_type, caught.value.message) == (
        "strategy_init", "RuntimeError", "no")


# --- per-client state on disk -----------------------------------------------------------------


def test_a_client_reads_the_newest_state_written_before_the_round(tmp_path: Path) -> None:
    store = ClientStore(tmp_path)
    store.write(1, 7, {"n": torch.tensor([1.0])})
    store.write(3, 7, {"n": torch.tensor([3.0])})
    assert store.read(7, before=1) == {}
    assert store.read(7, before=2)["n"].item() == 1.0
    assert store.read(7, before=3)["n"].item() == 1.0, "round 3's own version is not its input"
    assert store.read(7, before=4)["n"].item() == 3.0
    assert store.read(8, before=4) == {}


def test_prune_keeps_only_the_newest_committed_version_of_the_clients_written(tmp_path: Path) -> None:
    store = ClientStore(tmp_path)
    for server_round in (1, 2, 4):
        store.write(server_round, 0, {"n": torch.tensor([float(server_round)])})
    store.write(1, 1, {"n": torch.tensor([1.0])})
    store.write(2, 1, {"n": torch.tensor([2.0])})
    store.prune(2, [0])
    assert store.versions(0) == [2, 4], "round 4 is past the commit: kept"
    assert store.versions(1) == [1, 2], "client 1 was not written this round: untouched"


def test_an_uncommitted_attempts_versions_are_discarded_before_the_round_is_closed_again(
    tmp_path: Path,
) -> None:
    store = ClientStore(tmp_path)
    store.write(2, 0, {"n": torch.tensor([2.0])})
    store.write(3, 0, {"n": torch.tensor([3.0])})
    store.write(3, 5, {"n": torch.tensor([3.0])})
    store.discard_from(3)
    assert (store.versions(0), store.versions(5)) == ([2], [])
    assert store.read(0, before=4)["n"].item() == 2.0


def test_shared_state_reaches_every_client_beside_its_own_versioned_pruned_and_discarded_like_it(
    tmp_path: Path,
) -> None:
    store = ClientStore(tmp_path)
    for server_round in (1, 2, 3):
        store.write_shared(server_round, {"c": torch.tensor([float(server_round)])})
    store.write(1, 4, {"n": torch.tensor([1.0])})
    assert store.read(9, before=1) == {}
    assert store.read(9, before=3) == {"c": torch.tensor([2.0])}, "a client never aggregated gets it too"
    got = store.read(4, before=3)
    assert (got["c"].item(), got["n"].item()) == (2.0, 1.0)
    store.discard_from(3)
    store.prune(2, [])
    assert store.versions(SHARED) == [2] and store.clients() == [4]
    assert store.read(4, before=9)["c"].item() == 2.0


def test_shared_state_may_not_reuse_a_name_of_a_clients_own_state() -> None:
    own = {"c": torch.zeros(1)}
    assert set(check_client_state(3, own, {"c_shared": torch.zeros(1)})) == {"c"}
    with pytest.raises(ValueError, match=r"client_state\[3\] and shared_state both name \['c'\]"):
        check_client_state(3, own, {"c": torch.zeros(1)})


# --- checks -----------------------------------------------------------------------------------


def test_a_round_config_keeps_plain_values_and_refuses_anything_else() -> None:
    plain = {"mu": 0.1, "k": 3, "on": True, "s": "x"}
    assert check_config(plain) == plain
    for bad, message in [
        ({"t": torch.ones(1)}, "use a number, string or bool"),
        ({"x": float("nan")}, "not finite"),
        ({"bad key": 1}, "must match"),
        ({f"k{i}": i for i in range(65)}, "at most 64"),
        ([1], "must return a dict"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            check_config(bad)


def test_a_tensor_map_needs_tensors_under_good_names() -> None:
    assert set(check_tensor_map({"a.b": torch.ones(1)}, "extras")) == {"a.b"}
    with pytest.raises(TypeError, match="'a' is a float, not a tensor"):
        check_tensor_map({"a": 1.0}, "extras")
    with pytest.raises(ValueError, match="name '' must match"):
        check_tensor_map({"": torch.ones(1)}, "extras")


def test_a_tensor_map_holds_a_large_models_parameters_but_not_without_bound() -> None:
    from fedmq.common.strategy.checks import MAX_TENSORS

    one = torch.zeros(1)
    resnet_like = {f"layer{i}.weight": one for i in range(400)}  # SCAFFOLD: a control per parameter
    assert len(check_tensor_map(resnet_like, "extras")) == 400
    with pytest.raises(ValueError, match=f"at most {MAX_TENSORS}"):
        check_tensor_map({f"t{i}": one for i in range(MAX_TENSORS + 1)}, "extras")


MODEL = {"w": torch.zeros(4)}


@pytest.mark.parametrize(
    ("extras", "expected", "reason"),
    [
        ({"n": torch.tensor([float("inf")])}, None, "non_finite"),
        ({"n": 3}, None, "wrong_extras"),
        ({"n": torch.ones(1)}, frozenset({"count"}), "wrong_extras"),
        ({"n": torch.zeros(300_000)}, None, "wrong_extras"),  # > 2 × model + 1 MiB
    ],
    ids=["non-finite", "not-a-tensor", "unexpected-name", "too-big"],
)
def test_malformed_extras_are_refused_with_a_reason(
    extras: dict[str, Any], expected: frozenset[str] | None, reason: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        check_extras(extras, MODEL, expected)
    assert caught.value.reason == reason


def test_sound_extras_pass() -> None:
    check_extras({"count": torch.ones(1), "steps": torch.tensor(3)}, MODEL, None)
    check_extras({"count": torch.ones(1)}, MODEL, frozenset({"count"}))


def test_from_python_a_strategy_class_names_itself_in_the_spec() -> None:
    from tests.support.strategies import Counting

    job = fedmq.Job.model_validate({"name": "j", "task": "digits", "clients": {"total": 2}, "rounds": 1,
                                    "strategy": Counting})
    assert job.strategy == StrategySpec(name="tests.support.strategies:Counting")
    job = fedmq.Job.model_validate({"name": "j", "task": "digits", "clients": {"total": 2}, "rounds": 1,
                                    "strategy": {"name": Counting, "options": {"scale": 3.0}}})
    assert make_strategy(job.strategy).options.scale == 3.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("tests.support.strategies:NotStrategyOptions", "must subclass fedmq.StrategyOptions"),
        ("tests.support.strategies:AllowsExtra", "must keep extra='forbid'"),
    ],
)
def test_a_strategy_whose_options_would_let_unknown_ones_through_is_refused(name: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        strategy_options(name, {})
    with pytest.raises(ConfigError, match=said):
        make_strategy(StrategySpec(name=name))
