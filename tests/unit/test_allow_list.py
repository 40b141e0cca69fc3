"""The allow-list for code a job spec names: prefixes on dotted boundaries, the user's project in
their own process, and a refusal before anything is imported, naming the setting and the module."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from fedmq.common.allowlist import AllowList, CodeNotAllowed, allowing
from fedmq.common.coderefs import check_code, code_refs
from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import parse_job
from fedmq.common.refs import import_ref
from fedmq.common.settings import Settings
from fedmq.common.strategy.loading import make_strategy, strategy_options
from fedmq.common.task.loading import make_task, task_class
from tests.conftest import REPO, small_job

HOSTILE = ["subprocess:run", "os:system", "torch.hub:load", "this:x", "tests.support.outsider:Outsider"]
NEVER_IMPORTED = ("this", "tests.support.outsider")


@pytest.fixture(autouse=True)
def nothing_hostile_is_imported() -> Any:
    for name in NEVER_IMPORTED:
        assert name not in sys.modules, f"{name} was imported before the test"
    yield
    for name in NEVER_IMPORTED:
        assert name not in sys.modules, f"{name} was imported"


@pytest.mark.parametrize(
    ("module", "allowed"),
    [("acme", True), ("acme.tasks", True), ("acme.tasks.deep", True), ("acmeevil", False),
     ("acm", False), ("lab.x", True), ("lab", False), ("lab.xy", False)],
)
def test_a_prefix_allows_itself_and_its_submodules_on_dotted_boundaries(module: str, allowed: bool) -> None:
    assert AllowList.services(["acme", "lab.x"]).allows(module) is allowed


def test_the_default_allows_fedmqs_built_ins_only() -> None:
    default = AllowList.services(Settings(allowed_code="").allowed_prefixes)
    built_in = ("fedmq.tasks.digits", "fedmq.services.aggregator.strategies.fedavg", "fedmq.compat.miniray")
    for module in built_in:
        assert default.allows(module)
    for module in ("fedmq", "fedmq.services.cli.main", "fedmq.common.task.loading",
                   "tests.support.strategies", "examples.regression", "subprocess", "os", "torch.hub",
                   "this", "__main__"):
        assert not default.allows(module), module


@pytest.mark.parametrize("ref", HOSTILE)
def test_a_service_refuses_hostile_refs_before_importing_naming_the_setting_and_module(ref: str) -> None:
    with pytest.raises(CodeNotAllowed) as refused:
        import_ref(ref, "task", AllowList.services())
    module = ref.partition(":")[0]
    assert refused.value.module == module and refused.value.what == "task"
    assert "FEDMQ_ALLOWED_CODE" in str(refused.value) and repr(module) in str(refused.value)


@pytest.mark.parametrize("ref", HOSTILE[:4])
def test_the_users_own_process_refuses_the_standard_library_and_site_packages(
    ref: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the virtual environment lies under the project: site-packages still is not
    with pytest.raises(CodeNotAllowed):
        import_ref(ref, "task", AllowList.project())


def test_the_users_own_process_allows_its_project_and_nothing_installed_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    installed = tmp_path / ".venv" / "lib" / "site-packages"
    (installed / "theirs").mkdir(parents=True)
    (installed / "theirs" / "__init__.py").write_text("raise SystemExit('theirs was imported')")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.syspath_prepend(str(tmp_path))
    project = AllowList.project()
    assert project.allows("mine") and project.allows("mine.tasks")
    assert not project.allows("theirs") and "theirs" not in sys.modules
    assert not project.allows("no_such_module_anywhere")
    with pytest.raises(ConfigError, match="no module named 'no_such_module_anywhere'") as typo:
        project.check("no_such_module_anywhere.tasks", "task", "no_such_module_anywhere.tasks:T")
    assert not isinstance(typo.value, CodeNotAllowed)  # a typo in the user's own process, said so
    with pytest.raises(CodeNotAllowed):  # a service cannot tell: the setting decides
        AllowList.services().check("no_such_module_anywhere", "task", "no_such_module_anywhere:T")
    assert AllowList.project(["theirs"]).allows("theirs")  # the setting still allows an installed package
    assert not AllowList.services().allows("mine")  # a service has no project


def test_what_is_found_must_be_of_the_kind_asked_for_and_defined_in_an_allowed_module() -> None:
    allowed = AllowList.services(["tests.support.strategies"])
    with pytest.raises(ConfigError, match="not a subclass of fedmq.Task"):
        task_class("tests.support.strategies:Counting", allowed)
    with pytest.raises(CodeNotAllowed, match="'torch.nn.modules.module'"):
        import_ref("tests.support.strategies:nn.Module", "task", allowed)  # torch's class, reached by name
    with pytest.raises(ConfigError, match="dunder"):
        import_ref("tests.support.strategies:Counting.__init__.__globals__", "strategy", allowed)
    with allowing(allowed):
        assert make_strategy(parse_job({**_raw(), "strategy": "tests.support.strategies:Counting"}).strategy)


def test_a_wrappers_inner_strategy_is_checked_by_the_same_list() -> None:
    clipped = {"inner": {"name": "subprocess:run"}, "max_norm": 1.0}
    with pytest.raises(CodeNotAllowed, match="'subprocess'"):
        strategy_options("clipped", clipped, AllowList.services())
    spec = small_job(strategy={"name": "clipped", "options": clipped})
    with pytest.raises(CodeNotAllowed) as refused:
        make_strategy(spec.strategy, AllowList.services())
    assert refused.value.what == "strategy"


def test_a_mini_ray_trainer_is_checked_by_the_same_list_and_must_be_a_trainer() -> None:
    options = {"trainer": "os:system", "args": [], "init": {}, "kwargs": {}, "sync_interval": 1, "epochs": 1}
    with pytest.raises(CodeNotAllowed) as refused:
        make_task("fedmq.compat.miniray:WorkerTask", options, AllowList.services())
    assert refused.value.what == "trainer" and refused.value.module == "os"
    options["trainer"] = "tests.support.strategies:Counting"
    with pytest.raises(ConfigError, match="not a subclass of DataParallelTrainer"):
        make_task("fedmq.compat.miniray:WorkerTask", options, AllowList.services(["tests"]))


def test_code_refs_names_every_place_a_spec_names_code() -> None:
    inner = {"name": "clipped", "options": {"inner": {"name": "acme.s:S"}}}
    spec = parse_job({
        **_raw(),
        "task": {"name": "fedmq.compat.miniray:WorkerTask", "options": {"trainer": "lab.t:Trainer"}},
        "strategy": {"name": "clipped", "options": {"inner": inner}},
    })
    clipped = "fedmq.services.aggregator.strategies.clipped:Clipped"
    assert list(code_refs(spec)) == [
        ("task", "fedmq.compat.miniray:WorkerTask"), ("trainer", "lab.t:Trainer"),
        ("strategy", clipped), ("strategy", clipped), ("strategy", "acme.s:S"),
    ]
    with pytest.raises(CodeNotAllowed, match="'lab.t'"):
        check_code(spec, AllowList.services(["acme"]))
    with pytest.raises(CodeNotAllowed, match="'acme.s'"):
        check_code(spec, AllowList.services(["lab"]))
    check_code(spec, AllowList.services(["acme", "lab"]))
    assert list(code_refs(small_job())) == [
        ("task", "fedmq.tasks.digits:Digits"),
        ("strategy", "fedmq.services.aggregator.strategies.fedavg:FedAvg"),
    ]


def test_strategies_nested_too_deep_are_refused_without_recursing_further() -> None:
    options: dict[str, Any] = {"inner": {"name": "fedavg"}}
    for _ in range(9):  # within the spec's depth limit (common/speclimits), past the wrappers' 8
        options = {"inner": {"name": "clipped", "options": options}}
    with pytest.raises(ConfigError, match="nest at most"):
        spec = parse_job({**_raw(), "strategy": {"name": "clipped", "options": options}})
        check_code(spec, AllowList.services())


def test_the_setting_takes_module_prefixes_and_refuses_anything_else() -> None:
    assert Settings(allowed_code=" acme , lab.tasks,").allowed_prefixes == ("acme", "lab.tasks")
    assert Settings(allowed_code="").allowed_prefixes == ()
    for bad in ("acme-evil", "acme.", "*", "a b", "../x"):
        with pytest.raises(ValueError, match="not a module name"):
            Settings(allowed_code=bad)


def _raw() -> dict[str, Any]:
    return {"name": "j", "task": "digits", "clients": {"total": 2}, "rounds": 1}
