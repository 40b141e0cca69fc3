"""Test tiers: which tests need a real RabbitMQ broker, read from their code, and which are slow.

    rabbitmq  a test whose code, or a fixture's, or a tests.* function or class they call (to
              any depth), names `fresh_vhost` or `require_rabbitmq`; or one parametrised with
              the value "rabbitmq" (the `transport` fixture's RabbitMQ half)
    slow      everything under tests/e2e (real processes), and tests marked by hand

`make test-fast` runs `pytest -m "not rabbitmq and not slow"`. A test that reaches the broker
without the marker fails in tests/rabbit.py, so a miss here cannot go unnoticed.
"""

from __future__ import annotations

import dis
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from types import CodeType
from typing import Any

import pytest

BROKER_DOORS = frozenset({"fresh_vhost", "require_rabbitmq"})
E2E = Path(__file__).resolve().parent / "e2e"


def mark_tiers(items: list[pytest.Item]) -> None:
    """Add the `rabbitmq` and `slow` markers where they belong."""
    for item in items:
        if needs_rabbitmq(item):
            item.add_marker(pytest.mark.rabbitmq)
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.slow)


def needs_rabbitmq(item: pytest.Item) -> bool:
    """Whether the test, or a fixture it uses, reaches a real broker (see the module docstring)."""
    if not isinstance(item, pytest.Function):
        return False
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(isinstance(v, str) and v == "rabbitmq" for v in callspec.params.values()):
        return True
    code: list[Any] = [item.obj]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        # A parametrised fixture is judged by its parameter (above), not by all its branches.
        code += [d.func for d in defs if d.params is None]
    seen: set[CodeType] = set()
    return any(_reaches_broker(obj, seen) for obj in code)


def _reaches_broker(obj: Any, seen: set[CodeType]) -> bool:
    """Whether `obj`'s code names a broker door, directly or through tests.* code it uses."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(obj, type):
        return any(_reaches_broker(v, seen) for v in vars(obj).values() if inspect.isfunction(v))
    code = getattr(obj, "__code__", None)
    if not isinstance(code, CodeType) or code in seen:
        return False
    seen.add(code)
    for name, source in _names(code):
        if name in BROKER_DOORS:
            return True
        if source == ".":  # an attribute: only its name counts
            continue
        module = obj.__globals__ if source is None else getattr(sys.modules.get(source), "__dict__", {})
        target = module.get(name)
        if str(getattr(target, "__module__", "")).startswith("tests.") and _reaches_broker(target, seen):
            return True
    return False


def _names(code: CodeType) -> Iterator[tuple[str, str | None]]:
    """Each name `code` uses, with where it comes from: None (a global), "." (an attribute), a module."""
    module = ""
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            module = str(ins.argval)
        elif ins.opname == "IMPORT_FROM":
            yield str(ins.argval), module
        elif ins.opname in {"LOAD_GLOBAL", "LOAD_NAME"}:
            yield str(ins.argval), None
        elif ins.opname in {"LOAD_ATTR", "LOAD_METHOD"}:
            yield str(ins.argval), "."
    for const in code.co_consts:
        if isinstance(const, CodeType):  # nested functions, lambdas, comprehensions
            yield from _names(const)
