"""A job spec's references to code: fedmq's built-in names, and `package.module:Name` imported
under the allow-list.

    job spec ──name──▶ TASKS / STRATEGIES ──package.module:Name──▶ import_ref ──▶ the class
                                                     (allowlist.active refuses a module first)

What the spec itself checks (a strategy's name), what the loaders import (common/task/loading.py,
common/strategy/loading.py) and what the scheduler checks without importing (common/coderefs.py)
all start here; this module imports none of them.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from fedmq.common.allowlist import AllowList, active
from fedmq.common.errors import ConfigError, SetupError

# Built-in Tasks by name: each is written against the public contract only.
TASKS: Mapping[str, str] = {
    "digits": "fedmq.tasks.digits:Digits",
}

_STRATEGIES = "fedmq.services.aggregator.strategies"

# Built-in strategies by name: each written against the public contract only. Adding one is a
# module under services/aggregator/strategies/ and one line here.
STRATEGIES: Mapping[str, str] = {
    "fedavg": f"{_STRATEGIES}.fedavg:FedAvg",
    "average": f"{_STRATEGIES}.average:Average",
    "fedavgm": f"{_STRATEGIES}.fedavgm:FedAvgM",
    "weighted": f"{_STRATEGIES}.weighted:Weighted",
    "moving_average": f"{_STRATEGIES}.ema:MovingAverage",
    "fedprox": f"{_STRATEGIES}.fedprox:FedProx",
    "scaffold": f"{_STRATEGIES}.scaffold:Scaffold",
    "fedadagrad": f"{_STRATEGIES}.fedopt:FedAdagrad",
    "fedadam": f"{_STRATEGIES}.fedopt:FedAdam",
    "fedyogi": f"{_STRATEGIES}.fedopt:FedYogi",
    "dp_fedavg": f"{_STRATEGIES}.dp:DPFedAvg",
    "dp_fedavg_adaptive": f"{_STRATEGIES}.dp:AdaptiveDPFedAvg",
    "clipped": f"{_STRATEGIES}.clipped:Clipped",
    "median": f"{_STRATEGIES}.robust:Median",
    "trimmed_mean": f"{_STRATEGIES}.robust:TrimmedMean",
    "krum": f"{_STRATEGIES}.robust:Krum",
    "multi_krum": f"{_STRATEGIES}.robust:MultiKrum",
    "bulyan": f"{_STRATEGIES}.robust:Bulyan",
}


def check_strategy_name(name: str) -> None:
    """ConfigError unless `name` is a built-in or looks like `package.module:Class` (no import)."""
    if name in STRATEGIES or ":" in name:
        return
    close = difflib.get_close_matches(name, list(STRATEGIES), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"unknown strategy {name!r}{hint} built-in: {', '.join(STRATEGIES)}; "
        "or your own as 'package.module:Class'"
    )


def import_ref(ref: str, what: str, allowed: AllowList | None = None) -> Any:
    """Import `package.module:attr` (attr may be dotted) and return it; ConfigError on failure.

    The module must be allowed (`allowed`, else the list in force) before it is imported, and
    what is found must be defined in an allowed module too (not one an allowed module imported).
    """
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(
            f"{what} {ref!r} must be a built-in name ({', '.join(sorted(TASKS))}) "
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
