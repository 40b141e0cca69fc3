"""Job spec loading: valid examples, and refusals that name the field and what is allowed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import (
    JobSpec,
    StrategySpec,
    TaskSpec,
    load_job,
    parse_job,
)
from fedmq.common.strategy.loading import strategy_options

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def minimal(**extra: Any) -> dict[str, Any]:
    """The smallest valid spec, with sections replaced by `extra`."""
    task = {} if {"model", "data", "task"} & extra.keys() else {"task": "digits"}  # older specs: none
    return {"name": "job", **task, "clients": {"total": 4}, "rounds": 2, **extra}


def refusal(raw: Any) -> str:
    """The ConfigError message parse_job gives for raw."""
    with pytest.raises(ConfigError) as info:
        parse_job(raw)
    return str(info.value)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# --- valid specs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "example", ["digits.yaml", "digits-100.yaml", "digits-shards.yaml", "digits-dp.yaml"]
)
def test_every_shipped_example_loads(example: str) -> None:
    spec = load_job(EXAMPLES / example)
    assert isinstance(spec, JobSpec)
    assert spec.rounds > 0
    assert spec.clients.quorum <= spec.clients.sampled <= spec.clients.total


def test_digits_100_example_samples_10_of_100_with_quorum_8() -> None:
    spec = load_job(EXAMPLES / "digits-100.yaml")
    assert (spec.clients.total, spec.clients.sampled, spec.clients.quorum) == (100, 10, 8)
    assert spec.task.options["partition"] == {"kind": "dirichlet", "alpha": 0.5}
    assert spec.strategy == StrategySpec(name="fedavg", options={})


def test_digits_shards_example_uses_shards_and_fedavgm() -> None:
    spec = load_job(EXAMPLES / "digits-shards.yaml")
    assert spec.task.options["model"]["name"] == "cnn"
    assert spec.task.options["partition"] == {"kind": "shards", "shards_per_client": 2}
    assert spec.strategy == StrategySpec(name="fedavgm", options={"server_lr": 1.0, "server_momentum": 0.5})
    assert spec.train.momentum == 0.5


def test_a_minimal_spec_gets_the_documented_defaults() -> None:
    spec = parse_job(minimal())
    assert spec.seed == 0
    assert spec.task == TaskSpec(name="digits", options={})
    assert spec.strategy == StrategySpec(name="fedavg", options={})
    assert spec.evaluate.every == 1 and spec.evaluate.server and spec.evaluate.federated is None
    assert spec.objective is None
    assert spec.train.epochs == 1 and spec.train.lr == 0.05
    assert spec.max_round_retries == 2


def test_sampled_and_quorum_default_to_total() -> None:
    clients = parse_job(minimal(clients={"total": 7})).clients
    assert clients.sampled == 7
    assert clients.quorum == 7


def test_quorum_defaults_to_per_round_when_only_per_round_is_given() -> None:
    clients = parse_job(minimal(clients={"total": 7, "per_round": 3})).clients
    assert clients.sampled == 3
    assert clients.quorum == 3


def test_explicit_min_fit_is_the_quorum() -> None:
    clients = parse_job(minimal(clients={"total": 7, "per_round": 3, "min_fit": 2})).clients
    assert (clients.sampled, clients.quorum) == (3, 2)


def test_overrides_replace_top_level_values(tmp_path: Path) -> None:
    spec = load_job(EXAMPLES / "digits.yaml", overrides={"rounds": 3, "seed": 7})
    assert spec.rounds == 3
    assert spec.seed == 7
    assert spec.name == "digits-fedavg", "fields not overridden are kept"


def test_dotted_overrides_reach_nested_sections_and_create_missing_ones(tmp_path: Path) -> None:
    path = write(tmp_path, "name: j\ntask: digits\nclients: {total: 4}\nrounds: 2\n")
    spec = load_job(path, overrides={"train.lr": 0.25, "clients.per_round": 2})
    assert spec.train.lr == 0.25
    assert spec.clients.total == 4 and spec.clients.sampled == 2


def test_overrides_are_validated_like_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.lr: Input should be greater than 0"):
        load_job(EXAMPLES / "digits.yaml", overrides={"train.lr": -1.0})


def test_a_task_is_named_by_builtin_name_or_reference_with_options() -> None:
    assert parse_job(minimal(task="digits")).task == TaskSpec(name="digits")
    spec = parse_job(minimal(task={"name": "my_pkg.tasks:Speech", "options": {"n_mels": 40}}))
    assert spec.task == TaskSpec(name="my_pkg.tasks:Speech", options={"n_mels": 40})


def test_specs_written_before_tasks_name_the_digits_tasks_options() -> None:
    spec = parse_job(minimal(
        model={"name": "cnn", "channels": [8]},
        data={"name": "digits", "test_fraction": 0.3, "partition": {"kind": "iid"}},
    ))
    assert spec.task == TaskSpec(name="digits", options={
        "model": {"name": "cnn", "channels": [8]}, "test_fraction": 0.3, "partition": {"kind": "iid"},
    })


@pytest.mark.parametrize(
    "section",
    [
        {"model": {"entrypoint": "examples.plugins.my_model:build"}},
        {"data": {"entrypoint": "pkg.mod:load"}},
        {"train": {"entrypoint": "pkg.mod:train"}},
    ],
)
def test_old_plugin_entrypoints_fail_with_the_task_that_replaces_them(section: dict[str, Any]) -> None:
    message = refusal(minimal(**section))
    assert "replaced by" in message and "task: {name:" in message and "examples/plugins/my_task.py" in message


def test_evaluation_and_the_objective_are_spelt_out() -> None:
    spec = parse_job(minimal(
        evaluate={"every": 2, "server": False, "federated": {"clients": 3, "min": 2}},
        objective={"metric": "federated.loss", "mode": "min"},
    ))
    assert spec.evaluate.federated is not None and spec.evaluate.federated.quorum == 2
    assert [r for r in range(1, 3) if spec.evaluates(r)] == [2]
    assert spec.objective is not None and spec.objective.metric == "federated.loss"
    assert "objective.metric: String should match pattern" in refusal(minimal(objective={"metric": "acc"}))


def test_an_objective_no_evaluation_measures_is_refused_saying_what_to_add() -> None:
    server = refusal(minimal(evaluate={"server": False}, objective={"metric": "server.accuracy"}))
    assert "'server.accuracy' is never measured" in server and "evaluate.server: true" in server
    federated = refusal(minimal(objective={"metric": "federated.loss", "mode": "min"}))
    assert "'federated.loss' is never measured" in federated and "federated: {clients: N}" in federated
    assert parse_job(minimal(evaluate={"server": False}, objective={"metric": "train.loss"})).objective


def test_a_tasks_default_objective_is_left_out_when_the_job_does_not_measure_it() -> None:
    from fedmq.common.jobcheck import complete_spec

    assert complete_spec(parse_job(minimal(task="digits"))).objective is not None  # server.accuracy
    assert complete_spec(parse_job(minimal(task="digits", evaluate={"server": False}))).objective is None


# --- refusals --------------------------------------------------------------------------------


def test_a_misspelt_top_level_key_is_refused_with_a_suggestion() -> None:
    message = refusal(minimal(trian={"lr": 0.1}))
    assert "  - trian: unknown key; did you mean 'train'?" in message
    assert "allowed: name, seed, task, clients, rounds, train, evaluate, objective" in message


def test_a_misspelt_nested_key_names_its_dotted_path_and_suggests_the_right_key() -> None:
    message = refusal(minimal(train={"lr": 0.1, "epoch": 2}))
    assert "train.epoch: unknown key; did you mean 'epochs'?" in message
    assert "allowed: epochs, batch_size" in message


def test_a_misspelt_key_in_a_yaml_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "name: j\ntask: digits\nclients: {total: 4}\nrounds: 2\ntrain: {epoch: 2}\n")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    message = str(info.value)
    assert message.startswith(f"{path} is invalid:")
    assert "train.epoch: unknown key; did you mean 'epochs'?" in message


def test_every_bad_field_is_listed_on_its_own_line() -> None:
    message = refusal(minimal(rounds=0, train={"lr": -1.0}))
    lines = message.splitlines()
    assert lines[0] == "job spec is invalid:"
    assert any(line.startswith("  - rounds: ") for line in lines)
    assert any(line.startswith("  - train.lr: ") for line in lines)


def test_a_negative_learning_rate_names_train_lr() -> None:
    assert "train.lr: Input should be greater than 0" in refusal(minimal(train={"lr": -0.1}))


def test_per_round_above_total_names_clients_and_both_numbers() -> None:
    message = refusal(minimal(clients={"total": 4, "per_round": 5}))
    assert "clients: per_round (5) must not exceed total (4)" in message


def test_min_fit_above_per_round_is_refused() -> None:
    message = refusal(minimal(clients={"total": 10, "per_round": 3, "min_fit": 4}))
    assert "clients: min_fit (4) must not exceed per_round (3)" in message


def test_min_fit_above_total_is_refused_when_per_round_is_absent() -> None:
    message = refusal(minimal(clients={"total": 3, "min_fit": 4}))
    assert "min_fit (4) must not exceed per_round (3)" in message


def test_zero_clients_are_refused() -> None:
    assert "clients.total: Input should be greater than 0" in refusal(minimal(clients={"total": 0}))


def test_an_unknown_strategy_name_names_strategy_suggests_one_and_lists_the_built_ins() -> None:
    message = refusal(minimal(strategy={"name": "fedavgn"}))
    assert "  - strategy: " in message
    assert "unknown strategy 'fedavgn'; did you mean 'fedavg'?" in message
    assert "built-in: fedavg, average, fedavgm" in message
    assert "'package.module:Class'" in message


def options_refusal(strategy: Any) -> str:
    """The error building a spec's strategy options gives (what the CLI shows before publishing)."""
    spec = parse_job(minimal(strategy=strategy))
    with pytest.raises(ConfigError) as caught:
        strategy_options(spec.strategy.name, spec.strategy.options)
    return str(caught.value)


@pytest.mark.parametrize(
    "strategy",
    [{"name": "fedavgm", "server_momentum": 1.0}, {"name": "fedavgm", "options": {"server_momentum": 1.0}}],
    ids=["flat", "options"],
)
def test_a_bad_server_momentum_names_the_strategy_and_the_option(strategy: dict[str, Any]) -> None:
    message = options_refusal(strategy)
    assert "strategy 'fedavgm': invalid options (allowed: server_lr, server_momentum)" in message
    assert "  - strategy.options.server_momentum: Input should be less than 1" in message


def test_a_misspelt_strategy_option_suggests_the_right_one() -> None:
    message = options_refusal({"name": "fedavgm", "server_lr2": 1.0})
    assert "strategy.options.server_lr2: unknown option; did you mean 'server_lr'?" in message


def test_a_boolean_is_not_a_number_for_a_built_in_strategy_option() -> None:
    message = options_refusal({"name": "fedavgm", "server_lr": True})
    assert "server_lr: Input should be a valid number" in message


def test_a_misspelt_key_inside_a_nested_section_suggests_the_right_key() -> None:
    assert "did you mean 'clients'?" in refusal(minimal(evaluate={"federated": {"client": 3}}))


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("fedavgm", StrategySpec(name="fedavgm")),
        ({"name": "average"}, StrategySpec(name="average")),
        ({"name": "fedavgm", "server_lr": 1, "server_momentum": 0.9},
         StrategySpec(name="fedavgm", options={"server_lr": 1, "server_momentum": 0.9})),
        ({"name": "fedprox", "options": {"mu": 0.1}}, StrategySpec(name="fedprox", options={"mu": 0.1})),
        ({"name": "my_pkg.strategies:Mine"}, StrategySpec(name="my_pkg.strategies:Mine")),
    ],
    ids=["bare-name", "name-only", "flat-legacy", "options", "entrypoint"],
)
def test_every_written_form_of_strategy_reads_as_name_and_options(
    written: Any, expected: StrategySpec
) -> None:
    assert parse_job(minimal(strategy=written)).strategy == expected


def test_a_strategy_with_options_and_flat_keys_at_once_is_refused_naming_the_stray_key() -> None:
    message = refusal(minimal(strategy={"name": "fedavgm", "options": {}, "server_lr": 1.0}))
    assert "  - strategy.server_lr: unknown key" in message


def test_an_unknown_key_spelt_like_a_union_tag_keeps_its_name_in_the_path() -> None:
    assert "  - train.average: unknown key" in refusal(minimal(train={"average": 1}))


def test_an_unknown_optimizer_lists_the_allowed_names() -> None:
    message = refusal(minimal(train={"optimizer": "rmsprop"}))
    assert "train.optimizer: Input should be 'sgd' or 'adam' (got 'rmsprop')" in message


def test_a_malformed_task_reference_is_refused() -> None:
    assert "task.name: String should match pattern" in refusal(minimal(task="not a task"))


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"rounds": "many"}, "  - rounds: Input should be a valid integer"),
        ({"seed": 1.5}, "  - seed: Input should be a valid integer"),
        ({"train": {"lr": "fast"}}, "  - train.lr: Input should be a valid number"),
        ({"clients": [4]}, "  - clients: Input should be a valid dictionary"),
        ({"task": {"name": "digits", "options": [1]}}, "  - task.options: Input should be a valid dict"),
        ({"name": ["a"]}, "  - name: Input should be a valid string"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(
    section: dict[str, Any], expected: str
) -> None:
    assert expected in refusal(minimal(**section))


def test_missing_required_fields_are_named() -> None:
    message = refusal({"name": "job"})
    assert "  - clients: Field required" in message
    assert "  - rounds: Field required" in message


@pytest.mark.parametrize("raw", [None, [1, 2], "name: job", 3])
def test_a_top_level_that_is_not_a_mapping_is_refused(raw: Any) -> None:
    assert refusal(raw) == "job spec: expected a mapping of keys at the top level"


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", ""])
def test_a_yaml_file_that_is_not_a_mapping_is_refused(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="expected a mapping of keys at the top level") as info:
        load_job(path, overrides={"rounds": 3})
    assert str(info.value).startswith(str(path))


def test_invalid_yaml_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "name: [unclosed\nrounds: 2\n")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert str(info.value).startswith(f"{path} is not valid YAML:")


def test_a_missing_file_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert str(info.value) == f"cannot read job spec {path}: No such file or directory"


def test_config_errors_hide_the_pydantic_traceback() -> None:
    with pytest.raises(ConfigError) as info:
        parse_job(minimal(rounds=0))
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


def test_a_dotted_override_through_a_scalar_is_refused_as_a_config_error(tmp_path: Path) -> None:
    text = "name: j\ntask: digits\nclients: {total: 4}\nrounds: 2\n"
    with pytest.raises(ConfigError, match="rounds is not a section"):
        load_job(write(tmp_path, text), overrides={"rounds.max": 1})


def test_a_dotted_override_fills_an_empty_section(tmp_path: Path) -> None:
    text = "name: j\ntask: digits\nclients: {total: 4}\nrounds: 2\ntrain:\n"
    assert load_job(write(tmp_path, text), overrides={"train.lr": 0.1}).train.lr == 0.1


def test_a_boolean_is_not_accepted_as_a_number(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rounds: Input should be a valid integer"):
        load_job(write(tmp_path, "name: j\nclients: {total: 4}\nrounds: true\n"))


def test_exponent_numbers_without_a_dot_read_as_floats_as_users_write_them(tmp_path: Path) -> None:
    """YAML 1.1 reads `1e-5` as a string; a spec means the number (the docs write `delta: 1e-5`)."""
    text = (EXAMPLES / "digits.yaml").read_text()
    text = text.replace("lr: 0.05", "lr: 5e-2").replace(
        "strategy: {name: fedavg}", "strategy: {name: dp_fedavg, options: {delta: 1e-5, clip_norm: 2E0}}"
    )
    path = tmp_path / "job.yaml"
    path.write_text(text)
    spec = load_job(path)
    assert spec.train.lr == 0.05
    assert spec.strategy.options == {"delta": 1e-5, "clip_norm": 2.0}
    assert strategy_options(spec.strategy.name, spec.strategy.options) is not None


def test_dp_sgd_needs_a_clip_norm_and_a_noise_multiplier_and_names_each_bad_value() -> None:
    message = refusal(minimal(train={"dp_sgd": {"clip_norm": 0, "noise_multiplier": -1, "delta": 1}}))
    assert "train.dp_sgd.clip_norm: Input should be greater than 0" in message
    assert "train.dp_sgd.noise_multiplier: Input should be greater than or equal to 0" in message
    assert "train.dp_sgd.delta: Input should be less than 1" in message
    missing = refusal(minimal(train={"dp_sgd": {"clip_norm": 1}}))
    assert "train.dp_sgd.noise_multiplier: Field required" in missing
    spec = parse_job(minimal(train={"dp_sgd": {"clip_norm": 0.5, "noise_multiplier": 1.2}}))
    assert spec.train.dp_sgd is not None and spec.train.dp_sgd.delta == 1e-5
