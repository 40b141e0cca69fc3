"""No import circle among fedmq's modules: the import graph, read from the source, has no cycle.

Every module under the installed name `fedmq` (fedmq/, and common/ and services/ through its
links) is parsed with `ast`; each `import` and `from ... import` that names a fedmq module is an
edge to the deepest module it names (`from fedmq.common.bus import base` is an edge to
`fedmq.common.bus.base`; `from fedmq.common.bus import Bus` one to `fedmq.common.bus`). Counted:

    module level          yes, including inside `try`/`if` at the top of the module
    inside functions      yes: a lazy import is still a dependency, and the issue asks for none
    if TYPE_CHECKING:     no: never executed, it only names types for mypy

The packages a dotted name passes through (`fedmq`, `fedmq.common`, ...) are not edges: Python
runs their `__init__` on the way, but that is where the name lives, not what the module uses.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fedmq"


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name; the links to common/ and services/ are followed."""
    found: dict[str, Path] = {}
    files = (Path(top) / f for top, _, names in os.walk(package, followlinks=True) for f in names)
    for path in sorted(p for p in files if p.suffix == ".py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of a tree, leaving out the bodies of `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports_in(child)
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _imports(node)


def _deepest(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a fedmq module."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The fedmq modules that module `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            named = [f"{base}.{alias.name}" for alias in node.names]
        for dotted in named:
            target = _deepest(dotted, known)
            if target is not None and target != name:
                targets.add(target)
    return targets


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(package)
    return {name: edges(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        # Iterative, so a deep graph cannot reach the recursion limit.
        nonlocal counter
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(g.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(g.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(g):
        if node not in index:
            visit(node)
    return sorted(found)


def describe(component: list[str], g: dict[str, set[str]]) -> str:
    """A component, with the imports that hold it together."""
    members = set(component)
    lines = [" <-> ".join(component)]
    for name in component:
        for target in sorted(g[name] & members):
            lines.append(f"    {name} -> {target}")
    return "\n".join(lines)


def test_fedmq_has_no_import_cycle() -> None:
    g = graph()
    assert "fedmq.common.jobspec" in g and "fedmq.services.aggregator.service" in g  # the links resolve
    found = cycles(g)
    assert not found, "import cycles:\n" + "\n".join(describe(c, g) for c in found)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "fedmq"


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    package = write(
        tmp_path,
        {
            "fedmq/__init__.py": "",
            "fedmq/a.py": "from fedmq import b\n",
            "fedmq/b.py": "def f():\n    from fedmq.c import thing\n",
            "fedmq/c.py": "import fedmq.a\n",
            "fedmq/d.py": "import fedmq.a\n",
        },
    )
    assert cycles(graph(package)) == [["fedmq.a", "fedmq.b", "fedmq.c"]]


def test_imports_only_for_type_checking_are_not_edges(tmp_path: Path) -> None:
    package = write(
        tmp_path,
        {
            "fedmq/__init__.py": "",
            "fedmq/a.py": "from fedmq.b import B\n",
            "fedmq/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from fedmq.a import A\nelse:\n    import json\n"
            ),
        },
    )
    assert cycles(graph(package)) == []


@pytest.mark.parametrize(
    ("statement", "target"),
    [
        ("from fedmq.pkg import mod", "fedmq.pkg.mod"),
        ("from fedmq.pkg.mod import name", "fedmq.pkg.mod"),
        ("from fedmq.pkg import name", "fedmq.pkg"),
        ("import fedmq.pkg.mod", "fedmq.pkg.mod"),
        ("from . import mod", "fedmq.pkg.mod"),
    ],
)
def test_an_import_is_an_edge_to_the_deepest_module_it_names(
    tmp_path: Path, statement: str, target: str
) -> None:
    package = write(
        tmp_path,
        {
            "fedmq/__init__.py": "",
            "fedmq/pkg/__init__.py": "",
            "fedmq/pkg/mod.py": "",
            "fedmq/pkg/user.py": statement + "\n",
        },
    )
    assert graph(package)["fedmq.pkg.user"] == {target}
