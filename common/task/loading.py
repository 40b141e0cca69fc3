"""Finding and building a job's Task: a built-in name or `package.module:Class`, with its options."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from fedmq.common.allowlist import AllowList, active, allowing
from fedmq.common.errors import ConfigError, SetupError
from fedmq.common.task.contract import Task

if TYPE_CHECKING:
    from fedmq.common.jobspec import JobSpec

# Built-in Tasks by name: each is written against the public contract only.
BUILTIN: Mapping[str, str] = {
    "digits": "fedmq.tasks.digits:Digits",
}


def task_class(ref: str, allowed: AllowList | None = None) -> type[Task]:
    """The Task class a spec names, from an allowed module; ConfigError saying why it cannot be had."""
    target = import_ref(BUILTIN.get(ref, ref), what="task", allowed=allowed)
    if not (isinstance(target, type) and issubclass(target, Task)):
        raise ConfigError(f"task {ref!r} is a {type(target).__name__}, not a subclass of fedmq.Task")
    return target


def make_task(ref: str, options: Mapping[str, Any], allowed: AllowList | None = None) -> Task:
    """Instantiate the Task with the spec's options; bad options are a ConfigError naming them.

    `allowed` (default: the list in force, see allowlist.active) also governs what the Task's
    constructor imports by name in turn (a Mini-Ray trainer).
    """
    with allowing(allowed or active()):
        cls = task_class(ref)
        try:
            return cls(**dict(options))
        except ConfigError:
            raise
        except Exception as exc:
            detail = _option_errors(exc, options) or f"{type(exc).__name__}: {exc}"
            raise ConfigError(f"task {ref!r}: its options are invalid:\n{detail}") from None


def complete_spec(spec: JobSpec, allowed: AllowList | None = None) -> JobSpec:
    """Check the spec's Task and strategy can be had with their options, and fill in the Task's
    default objective.

    What the CLI and the Python API do before a job is published: a bad option fails here,
    in the user's terminal, not minutes later in a service.
    """
    from fedmq.common.strategy.loading import check_strategy

    if spec.ddp is not None:  # no Task nor strategy: its entry is checked against the allow-list
        from fedmq.common.coderefs import check_code

        check_code(spec, allowed or active())
        return spec
    with allowing(allowed or active()):
        task = make_task(spec.task.name, spec.task.options)
        check_strategy(spec)  # its options, and whether they can work with the rest of the job
    if spec.objective is None and task.objective is not None and spec.measures(task.objective.metric):
        objective = {"metric": task.objective.metric, "mode": task.objective.mode}
        return type(spec).model_validate({**spec.model_dump(mode="json"), "objective": objective})
    return spec


def import_ref(ref: str, what: str, allowed: AllowList | None = None) -> Any:
    """Import `package.module:attr` (attr may be dotted) and return it; ConfigError on failure.

    The module must be allowed (`allowed`, else the list in force) before it is imported, and
    what is found must be defined in an allowed module too (not one an allowed module imported).
    """
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(
            f"{what} {ref!r} must be a built-in name ({', '.join(sorted(BUILTIN))}) "
            "or look like 'package.module:Name'"
        )
    allowed = allowed or active()
    allowed.check(module_name, what, ref)
    if any(part.startswith("__") for part in attr_path.split(".")):
        raise ConfigError(f"{what} {ref!r}: name a class, not a dunder attribute")
    try:
        module = _running_script(module_name) or importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise SetupError(
                f"{what} {ref!r}: no module named {exc.name!r}; is it installed or on PYTHONPATH? "
                f"(working directory: {os.getcwd()})"
            ) from None
        raise ConfigError(f"{what} {ref!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"{what} {ref!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(
                f"{what} {ref!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    defined_in = getattr(target, "__module__", None)
    if defined_in == "__main__" and module is sys.modules.get("__main__"):
        defined_in = module_name  # the running script, named as it was
    if isinstance(target, type) and isinstance(defined_in, str) and defined_in != module_name:
        allowed.check(defined_in, what, f"{defined_in}:{getattr(target, '__qualname__', attr_path)}")
    return target


def ref_of(cls: type) -> str:
    """The `package.module:Name` that imports `cls` again elsewhere (a script's `__main__` resolved)."""
    module = cls.__module__
    if module == "__main__":
        module = _main_module_name() or module
    return f"{module}:{cls.__qualname__}"


def _running_script(module_name: str) -> ModuleType | None:
    """The running script itself when `module_name` names it and nothing imported it under that
    name: imported again, its top level would run again (a training started without a
    `if __name__ == "__main__":` guard would start another, inside this one)."""
    if module_name in sys.modules or _main_module_name() != module_name:
        return None
    return sys.modules.get("__main__")


def _main_module_name() -> str | None:
    """The importable name of the running script, from its file and sys.path (None if none)."""
    import sys

    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name:
        return str(spec_name)
    path = getattr(main, "__file__", None)
    if not path:
        return None
    path = os.path.realpath(path)
    for entry in sys.path:
        base = os.path.realpath(entry or os.getcwd())
        if path.startswith(base + os.sep) and path.endswith(".py"):
            return path[len(base) + 1 : -3].replace(os.sep, ".")
    return None


def _option_errors(exc: Exception, options: Mapping[str, Any]) -> str:
    """A pydantic ValidationError or a TypeError from __init__, as one line per problem."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        lines = []
        for err in errors():
            where = ".".join(_yaml_path(tuple(err.get("loc", ())), options)) or "(options)"
            lines.append(f"  - task.options.{where}: {err.get('msg')}")
        return "\n".join(lines)
    if isinstance(exc, TypeError) and "argument" in str(exc):
        return f"  - {exc}"
    return ""


def _yaml_path(loc: tuple[Any, ...], options: Any) -> list[str]:
    """An error location as the user wrote it: a discriminated union's tag (e.g. "mlp" in
    model.mlp.hidden, when the user wrote model: {name: mlp}) is not part of their path."""
    path, node = [], options
    for part in loc:
        if isinstance(node, Mapping) and part not in node and part in node.values():
            continue
        path.append(str(part))
        node = (
            node.get(part)
            if isinstance(node, Mapping)
            else (
                node[part] if isinstance(node, list) and isinstance(part, int) and part < len(node) else None
            )
        )
    return path


def signature_options(cls: type[Task]) -> list[str]:
    """The option names a Task accepts (for messages), from `Options` or `__init__`."""
    if cls.Options is not None:
        return list(cls.Options.model_fields)
    params = inspect.signature(cls.__init__).parameters
    return [p for p in params if p != "self" and params[p].kind is not inspect.Parameter.VAR_KEYWORD]
