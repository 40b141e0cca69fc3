"""Finding and building a job's strategy: a built-in name or `package.module:Class`, with its options.

Adding a built-in strategy is one module under services/aggregator/strategies/ and one line in
common/refs.py.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError as PydanticValidationError

from fedmq.common.allowlist import AllowList, active, allowing
from fedmq.common.errors import ConfigError
from fedmq.common.refs import STRATEGIES, check_strategy_name, import_ref
from fedmq.common.strategy.contract import JobFacts, Strategy, StrategyOptions
from fedmq.common.usercode import user_code

if TYPE_CHECKING:
    from fedmq.common.jobspec import JobSpec, StrategySpec

BUILTIN = STRATEGIES  # built-in strategies by name (common/refs.py)


def strategy_class(name: str, allowed: AllowList | None = None) -> type[Strategy]:
    """The Strategy class a spec names, from an allowed module; ConfigError saying why it cannot be had."""
    check_strategy_name(name)
    target = import_ref(BUILTIN.get(name, name), what="strategy", allowed=allowed)
    if not (isinstance(target, type) and issubclass(target, Strategy)):
        raise ConfigError(f"strategy {name!r} is a {type(target).__name__}, not a subclass of fedmq.Strategy")
    check_options_class(name, target)
    return target


def check_options_class(name: str, cls: type[Strategy]) -> None:
    """ConfigError unless the strategy's `Options` subclasses fedmq.StrategyOptions and refuses
    unknown options: a misspelt option must fail before the job is published, not be ignored."""
    options = cls.Options
    if not (isinstance(options, type) and issubclass(options, StrategyOptions)):
        raise ConfigError(
            f"strategy {name!r}: its Options ({getattr(options, '__name__', options)!r}) must subclass "
            "fedmq.StrategyOptions, e.g. `class Options(fedmq.StrategyOptions): bound: float = 1.0`"
        )
    if options.model_config.get("extra") != "forbid":
        raise ConfigError(
            f"strategy {name!r}: its Options ({options.__name__}) must keep extra='forbid' from "
            "fedmq.StrategyOptions, so that an unknown option is an error"
        )


def strategy_options(
    name: str, options: Mapping[str, Any], allowed: AllowList | None = None
) -> StrategyOptions:
    """The strategy's `Options` built from the spec; ConfigError naming each bad option.

    `allowed` (default: the list in force) also governs strategies the options name (clipped's inner).
    """
    with allowing(allowed or active()):
        return _options(strategy_class(name), name, options)


def check_strategy(spec: JobSpec, allowed: AllowList | None = None) -> StrategyOptions:
    """The job's strategy options, checked against the rest of the job by the strategy's
    `check_job`; ConfigError saying what to change. `allowed` as for `strategy_options`."""
    name = spec.strategy.name
    with allowing(allowed or active()):
        cls = strategy_class(name)
        options = _options(cls, name, spec.strategy.options)
    try:
        cls.check_job(options, job_facts(spec))
    except ConfigError as exc:
        raise ConfigError(f"strategy {name!r} cannot run this job: {exc}") from None
    except Exception as exc:
        detail = str(exc) if isinstance(exc, ValueError) else f"check_job raised {type(exc).__name__}: {exc}"
        raise ConfigError(f"strategy {name!r} cannot run this job: {detail}") from None
    return options


def job_facts(spec: JobSpec) -> JobFacts:
    """What a strategy's `check_job` sees of the spec."""
    return JobFacts(
        clients_total=spec.clients.total, clients_per_round=spec.clients.sampled,
        min_fit=spec.clients.quorum, rounds=spec.rounds, optimizer=spec.train.optimizer,
        lr=spec.train.lr, momentum=spec.train.momentum, weight_decay=spec.train.weight_decay,
    )


def make_strategy(spec: StrategySpec, allowed: AllowList | None = None) -> Strategy:
    """The job's strategy, built with its validated options; a user's constructor raising is user code."""
    with allowing(allowed or active()):
        cls = strategy_class(spec.name)
        options = _options(cls, spec.name, spec.options)
        with user_code("strategy_init"):
            strategy = cls(options)
    return strategy


def _options(cls: type[Strategy], name: str, options: Mapping[str, Any]) -> StrategyOptions:
    try:
        return cls.Options(**dict(options))
    except PydanticValidationError as exc:
        allowed = list(cls.Options.model_fields)
        lines = [_option_error(err, allowed) for err in exc.errors()]
        shown = ", ".join(allowed) or "none"
        raise ConfigError(
            f"strategy {name!r}: invalid options (allowed: {shown}):\n" + "\n".join(lines)
        ) from None


def _option_error(err: Any, allowed: list[str]) -> str:
    where = ".".join(str(p) for p in err.get("loc", ())) or "(options)"
    if err.get("type") == "extra_forbidden":
        close = difflib.get_close_matches(where, allowed, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"  - strategy.options.{where}: unknown option{hint}"
    return f"  - strategy.options.{where}: {err.get('msg')}"
