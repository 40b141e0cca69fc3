"""Finding and building a job's Task: a built-in name or `package.module:Class`, with its options."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from fedmq.common.allowlist import AllowList, active, allowing
from fedmq.common.errors import ConfigError
from fedmq.common.refs import TASKS, import_ref
from fedmq.common.task.contract import Task

BUILTIN = TASKS  # built-in Tasks by name (common/refs.py)


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
