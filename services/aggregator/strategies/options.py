"""The base of the built-in strategies' options: strict like the job spec (YAML `true` is not a number)."""

from __future__ import annotations

from pydantic import ConfigDict

from fedmq.common.strategy.contract import StrategyOptions


class BuiltinOptions(StrategyOptions):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
