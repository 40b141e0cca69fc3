"""Which modules a job spec may name code from, checked before anything is imported.

A spec names code (its Task, its strategy, a wrapper's inner strategy, a Mini-Ray trainer) as
`package.module:Name`, and importing a module runs it. So every service checks the module
against an allow-list first:

    services (scheduler, aggregator, learners):  fedmq's built-ins + FEDMQ_ALLOWED_CODE
    the user's own process (`fedmq run`, `fedmq.run`, `fedmq.load_model`, `fedmq submit`'s
    check):  the same, plus the user's project: a module whose top-level package's files lie
             under the working directory, the job spec's directory or the running script's
             directory, and not in the standard library or site-packages; and `__main__`

A prefix matches on dotted boundaries: `acme` allows `acme` and `acme.tasks`, not `acmeevil`.
Finding where a project module lives looks up its top-level name only (as `import` would, in
sys.modules and on sys.path): nothing is executed. The target found must also be of the kind
asked for and defined in an allowed module; the callers (task and strategy loading) check that.
"""

from __future__ import annotations

import importlib.util
import os
import re
import site
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path

from fedmq.common.errors import ConfigError, SetupError

SETTING = "FEDMQ_ALLOWED_CODE"

# The modules of fedmq a spec may name: built-in Tasks, built-in strategies, the Mini-Ray bridge.
BUILTIN_PREFIXES = ("fedmq.tasks", "fedmq.services.aggregator.strategies", "fedmq.compat.miniray")

MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class CodeNotAllowed(ConfigError):
    """A spec names code from a module outside the allow-list; nothing was imported."""

    def __init__(self, message: str, what: str, module: str) -> None:
        super().__init__(message)
        self.what = what
        self.module = module


def parse_prefixes(value: str) -> tuple[str, ...]:
    """`acme, lab.tasks` -> ('acme', 'lab.tasks'); ValueError naming a prefix that is not a module name."""
    prefixes = tuple(p.strip() for p in value.split(",") if p.strip())
    for prefix in prefixes:
        if not MODULE.match(prefix):
            raise ValueError(f"{prefix!r} is not a module name: write package prefixes like acme,lab.tasks")
    return prefixes


def under_prefix(module: str, prefixes: Iterable[str]) -> bool:
    """Whether `module` is one of `prefixes` or inside one, on dotted boundaries."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class AllowList:
    """Module prefixes a spec may name code from, and (in the user's own process) project folders."""

    prefixes: tuple[str, ...] = ()
    roots: tuple[Path, ...] = ()  # the user's project: folders whose (non-library) modules are allowed
    main: bool = False  # the running program's `__main__` (a Task defined in a notebook or script)

    @classmethod
    def services(cls, prefixes: Iterable[str] = ()) -> AllowList:
        """What a service allows: fedmq's built-ins and the operator's prefixes."""
        return cls(prefixes=tuple(prefixes))

    @classmethod
    def project(cls, prefixes: Iterable[str] = (), *, spec_dir: Path | None = None) -> AllowList:
        """What the user's own process allows: the services' list, plus the project around it."""
        roots = [Path.cwd()]
        if spec_dir is not None:
            roots.append(spec_dir)
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        if script and not _is_library(script):  # a script of the user's, not `python -m pytest`
            roots.append(Path(script).parent)
        unique = dict.fromkeys(Path(os.path.realpath(r)) for r in roots)
        return cls(prefixes=tuple(prefixes), roots=tuple(unique), main=True)

    def allows(self, module: str) -> bool:
        """Whether code may be imported from `module` (looked up, never imported)."""
        if not MODULE.match(module):
            return False
        if under_prefix(module, (*BUILTIN_PREFIXES, *self.prefixes)):
            return True
        top = module.split(".", 1)[0]
        if top == "__main__":
            return self.main and module == "__main__"
        return bool(self.roots) and _in_project(top, self.roots)

    def check(self, module: str, what: str, ref: str) -> None:
        """CodeNotAllowed, naming the setting and the module, unless `module` is allowed."""
        if self.allows(module):
            return
        top = module.split(".", 1)[0]
        if self.roots and MODULE.match(module) and _find(top) is None:  # a typo, not a hostile name
            raise SetupError(
                f"{what} {ref!r}: no module named {top!r}; is it installed or on PYTHONPATH? "
                f"(working directory: {os.getcwd()})"
            )
        raise CodeNotAllowed(self.refusal(module, what, ref), what, module)

    def refusal(self, module: str, what: str, ref: str) -> str:
        allowed = ", ".join((*BUILTIN_PREFIXES, *self.prefixes))
        top = module.split(".", 1)[0]
        where = (
            f"; your project's own modules (files under {', '.join(str(r) for r in self.roots)}, "
            "outside the standard library and site-packages) are allowed too"
            if self.roots else ""
        )
        return (
            f"{what} {ref!r}: module {module!r} is not allowed: fedmq imports code a job names only "
            f"from the module prefixes in {SETTING} (now: {allowed}){where}. If you trust it, add its "
            f"package to {SETTING} (e.g. {SETTING}={top}) for every service and run again"
        )


def _library_dirs() -> tuple[str, ...]:
    """The standard library's and the installed packages' folders: never the user's project."""
    paths = sysconfig.get_paths()
    dirs = [paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    dirs += [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    return tuple(os.path.realpath(d) for d in dirs if d)


def _is_library(path: str) -> bool:
    real = os.path.realpath(path)
    parts = Path(real).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    return any(real == d or real.startswith(d + os.sep) for d in _library_dirs())


def _find(top: str) -> ModuleSpec | None:
    """Where `import top` would load the top-level module from, found without running it."""
    try:
        return importlib.util.find_spec(top)  # a top-level name: no parent package runs
    except (ImportError, ValueError):
        return None


def _in_project(top: str, roots: tuple[Path, ...]) -> bool:
    """Whether the top-level module `top` is found (not imported) in files under one of `roots`."""
    spec = _find(top)
    if spec is None:
        return False
    places = list(spec.submodule_search_locations or [])
    if spec.origin and spec.has_location:
        places.append(spec.origin)
    if not places:
        return False  # built into the interpreter (sys), frozen, or a namespace with no folder
    bases = [str(r) for r in roots]
    for place in places:
        real = os.path.realpath(place)
        if _is_library(real) or not any(real == b or real.startswith(b + os.sep) for b in bases):
            return False
    return True


# The list in force for what this thread imports now: a service sets it around building a job,
# so that code a built-in imports in turn (a wrapper's inner strategy) is checked by the same list.
_ACTIVE: ContextVar[AllowList | None] = ContextVar("fedmq_allow_list", default=None)


@contextmanager
def allowing(allowed: AllowList) -> Iterator[AllowList]:
    """Make `allowed` the list for imports of spec-named code in this thread, within the block."""
    token = _ACTIVE.set(allowed)
    try:
        yield allowed
    finally:
        _ACTIVE.reset(token)


def active() -> AllowList:
    """The list in force; outside any service, the user's own process: its project and the setting."""
    current = _ACTIVE.get()
    if current is not None:
        return current
    try:
        prefixes = parse_prefixes(os.environ.get(SETTING, ""))
    except ValueError as exc:
        raise ConfigError(f"setting {SETTING}: {exc}") from None
    return AllowList.project(prefixes)
