"""Every place a job spec names code, found without importing it: what the scheduler checks.

    task.name                                   the Task (a built-in name or package.module:Class)
    task.options.trainer                        with the Mini-Ray bridge's WorkerTask: the trainer
    strategy.name                               the strategy
    strategy.options.inner (clipped), nested    the wrapped strategy, and what it names in turn
    ddp.entry                                   a DDP job's entry (its only code)

The aggregator and learners check each import again when they build the job (allowlist.active),
so a spec that reaches them some other way is refused there too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from fedmq.common.allowlist import AllowList
from fedmq.common.errors import ConfigError
from fedmq.common.jobspec import JobSpec, StrategySpec
from fedmq.common.refs import STRATEGIES, TASKS

MINIRAY_TASK = "fedmq.compat.miniray:WorkerTask"
CLIPPED = STRATEGIES["clipped"]
MAX_NESTING = 8  # clipped(clipped(...)): deeper is refused, not followed


def code_refs(spec: JobSpec) -> Iterator[tuple[str, str]]:
    """(what, `package.module:Name`) for each piece of code the spec names, built-ins resolved."""
    if spec.ddp is not None:
        yield "entry", spec.ddp.entry
        return
    task = TASKS.get(spec.task.name, spec.task.name)
    yield "task", task
    trainer = spec.task.options.get("trainer")
    if task == MINIRAY_TASK and isinstance(trainer, str):
        yield "trainer", trainer
    yield from _strategy_refs(spec.strategy.name, spec.strategy.options, 0)


def _strategy_refs(name: str, options: Mapping[str, Any], depth: int) -> Iterator[tuple[str, str]]:
    ref = STRATEGIES.get(name, name)
    yield "strategy", ref
    if ref != CLIPPED or "inner" not in options:
        return
    if depth >= MAX_NESTING:
        raise ConfigError(f"strategy.options.inner: wrappers nest at most {MAX_NESTING} deep")
    try:
        inner = StrategySpec.model_validate(options["inner"])
    except PydanticValidationError:
        return  # not a strategy at all: the strategy's own options check refuses it, importing nothing
    yield from _strategy_refs(inner.name, inner.options, depth + 1)


def check_code(spec: JobSpec, allowed: AllowList) -> None:
    """CodeNotAllowed for the first piece of code the spec names from a module `allowed` refuses."""
    for what, ref in code_refs(spec):
        module, sep, _ = ref.partition(":")
        if sep:  # a bare unknown name imports nothing: loading refuses it with its own message
            allowed.check(module, what, ref)
