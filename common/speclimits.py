"""Size limits of a job spec, checked before anything walks it: YAML bombs, deep nesting, huge blobs.

    YAML text ─▶ bytes ≤ MAX_SPEC_BYTES ─▶ events (no objects built): nodes with every alias
        expanded ≤ MAX_NODES, depth ≤ MAX_DEPTH, no recursive alias ─▶ yaml.safe_load
    any mapping (a JobSubmit from the broker, a dict from Python) ─▶ check_tree: nodes, depth,
        encoded bytes, and each options section ≤ MAX_OPTIONS_BYTES

A spec rides in every TrainTask, so it must stay small (kilobytes); these bounds are far above any
real spec and far below what would hurt. Each check stops as soon as a bound is passed, so a
refusal costs at most the bound's worth of work. Every refusal is a SpecTooLarge (a ConfigError)
naming the bound, what was found and what to do.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml

from fedmq.common.errors import ConfigError

KiB = 1024
MAX_SPEC_BYTES = 256 * KiB  # the YAML file, and a spec's encoded size
MAX_OPTIONS_BYTES = 64 * KiB  # one options section (task, train, strategy), encoded
MAX_DEPTH = 32  # nested mappings and lists
MAX_NODES = 20_000  # mappings, lists and scalars, aliases expanded
SCALAR_BYTES = 8  # what a number, bool or null counts for in a spec's encoded size
OPTION_SECTIONS = ("task", "train", "strategy")


class SpecTooLarge(ConfigError):
    """A spec past one of the bounds above; `limit` names it (a bounded metric label)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class SpecLoader(yaml.SafeLoader):
    """YAML's safe loader that also reads `1e-5` as a float, as a user means it (YAML 1.1 wants `1.0e-5`)."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str, source: str) -> Any:
    """The YAML document in `text`, refused (SpecTooLarge) before it is built if it is too large."""
    size = len(text.encode("utf-8"))
    if size > MAX_SPEC_BYTES:
        raise SpecTooLarge("spec_bytes", f"{source}: {size} bytes, more than the {MAX_SPEC_BYTES} a job "
                           "spec may have; keep data and large options in files the Task reads")
    check_yaml_events(yaml.parse(text, Loader=SpecLoader), source)
    return yaml.load(text, Loader=SpecLoader)  # noqa: S506 - a SafeLoader subclass


def check_yaml_events(events: Iterator[yaml.Event], source: str) -> int:
    """Walk a YAML event stream counting the nodes an object build would make; return the count.

    An alias counts the nodes of its anchor again (that is what makes a "billion laughs" bomb),
    and its anchor's depth adds to where it stands. Nothing is built, nothing recurses.
    """
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, depth below it)
    stack: list[list[Any]] = []  # open collections: [anchor, nodes so far, deepest child]
    total = 0

    def add(nodes: int, depth: int) -> None:
        nonlocal total
        total += nodes
        if total > MAX_NODES:
            raise SpecTooLarge("spec_nodes", f"{source}: more than {MAX_NODES} values once its aliases "
                               "(*name) are expanded; write the values out, or keep them in a file")
        if len(stack) + depth > MAX_DEPTH:
            raise SpecTooLarge("spec_depth", f"{source}: nested more than {MAX_DEPTH} levels deep")
        if stack:
            stack[-1][1] += nodes
            stack[-1][2] = max(stack[-1][2], depth)

    for event in events:
        if isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes:  # its anchor is still open: a recursive alias
                raise SpecTooLarge("spec_nodes", f"{source}: alias *{event.anchor} refers to itself")
            add(*sizes[event.anchor])
        elif isinstance(event, yaml.ScalarEvent):
            add(1, 1)
            if event.anchor:
                sizes[event.anchor] = (1, 1)
        elif isinstance(event, yaml.CollectionStartEvent):
            add(1, 1)  # the collection itself; its children add to it as they come
            stack.append([event.anchor, 1, 0])
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, nodes, deepest = stack.pop()
            if anchor:
                sizes[anchor] = (nodes, deepest + 1)
            if stack:  # the collection's children count towards its parent too
                stack[-1][1] += nodes - 1
                stack[-1][2] = max(stack[-1][2], deepest + 1)
    return total


def check_tree(raw: Any, source: str = "job spec") -> None:
    """Refuse a spec mapping with too many values, too deep, too many bytes, or a huge options blob."""
    measure(raw, source, MAX_SPEC_BYTES, "spec_bytes")
    if not isinstance(raw, dict):
        return
    for section in OPTION_SECTIONS:
        value = raw.get(section)
        options = value.get("options") if isinstance(value, dict) else None
        if options is not None:
            measure(options, f"{source}: {section}.options", MAX_OPTIONS_BYTES, "options_bytes")
    strategy = raw.get("strategy")
    if isinstance(strategy, dict) and "options" not in strategy:  # the flat form: options beside the name
        flat = {k: v for k, v in strategy.items() if k != "name"}
        measure(flat, f"{source}: strategy options", MAX_OPTIONS_BYTES, "options_bytes")


def measure(value: Any, source: str, max_bytes: int, limit: str) -> int:
    """The encoded size of `value` (strings by their UTF-8 bytes, other scalars SCALAR_BYTES),
    refusing it once it passes `max_bytes`, MAX_NODES values or MAX_DEPTH levels."""
    size = nodes = 0
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise SpecTooLarge("spec_nodes", f"{source}: more than {MAX_NODES} values")
        if depth > MAX_DEPTH:
            raise SpecTooLarge("spec_depth", f"{source}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            for key, child in item.items():
                size += _scalar_bytes(key)
                pending.append((child, depth + 1))
        elif isinstance(item, list | tuple):
            pending.extend((child, depth + 1) for child in item)
        else:
            size += _scalar_bytes(item)
        if size > max_bytes:
            raise SpecTooLarge(limit, f"{source}: more than {max_bytes} bytes; keep large data in "
                               "files the Task reads, and name them in the options")
    return size


def _scalar_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "replace"))
    if isinstance(value, bytes | bytearray):
        return len(value)
    return SCALAR_BYTES
