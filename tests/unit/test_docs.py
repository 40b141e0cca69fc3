"""The docs site's generated pages match their sources, and the README stays a short front door.

`make docs` builds the site with `mkdocs build --strict` (broken links, pages out of the nav);
these tests check what that build cannot: that no generated figure or table has drifted.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import yaml

from fedmq.common.settings import Settings
from fedmq.common.strategy.loading import BUILTIN

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def benchmarks_report() -> ModuleType:
    """benchmarks/report.py, which is a script beside the benchmarks, not a package module."""
    spec = importlib.util.spec_from_file_location("benchmarks_report", REPO / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_matches_the_settings_class() -> None:
    from fedmq.common.settings_doc import render

    page = (DOCS / "configuration.md").read_text()
    assert render(page) == page, "run: python -m fedmq.common.settings_doc --write docs/configuration.md"


def test_the_configuration_page_names_every_setting_once() -> None:
    page = (DOCS / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert page.count(f"| `FEDMQ_{name.upper()}` |") == 1, name


def test_the_benchmarks_page_is_rendered_from_the_saved_results() -> None:
    report = benchmarks_report()
    page = (DOCS / "benchmarks.md").read_text()
    assert report.render(page, report.load()) == page, (
        "run: python benchmarks/report.py --write docs/benchmarks.md")


def test_the_benchmarks_page_fails_on_a_changed_figure() -> None:
    report = benchmarks_report()
    results = report.load()
    if results is None or not results["targets"]:
        results = {"when": "then", "machine": "here", "seconds": 1, "failed": [], "reports": {},
                   "targets": [{"target": "t", "what": "w", "figure": 1.0, "baseline": 2.0, "ratio": 0.5,
                                "unit": "s", "goal": "ratio <= 1", "met": True, "benchmark": "b.py"}]}
    page = report.render((DOCS / "benchmarks.md").read_text(), results)
    results["targets"][0]["figure"] = 12345.678
    assert report.render(page, results) != page


def test_the_strategies_page_lists_every_builtin_strategy() -> None:
    page = (DOCS / "strategies.md").read_text()
    table = page[page.index("| name | options | what it does |"):]
    table = table[:table.index("\n\n")]
    names = {n for line in table.splitlines()[2:] for n in re.findall(r"`([a-z_]+)`", line.split("|")[1])}
    assert names == set(BUILTIN)


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(entries: list[object]) -> list[str]:
        found: list[str] = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            found += pages(value) if isinstance(value, list) else [str(value)]
        return found

    assert sorted(pages(config["nav"])) == sorted(p.name for p in DOCS.glob("*.md"))


def test_the_readme_is_short_starts_with_two_commands_and_links_only_to_pages_that_exist() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    first_block = readme[readme.index("```sh"):]
    first_block = first_block[:first_block.index("```", 5)]
    assert re.findall(r"^make (\w+)", first_block, flags=re.MULTILINE) == ["run", "test"]
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]*)?\)", readme)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (REPO / link).is_file()]
    assert not missing, missing
