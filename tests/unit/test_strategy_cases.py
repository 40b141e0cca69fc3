"""tests/support/strategy_cases.py covers the built-in strategies exactly: a new built-in without a
digits case (so missing from the end-to-end test and the benchmarks page's accuracy table) fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmq.common.jobspec import parse_job
from fedmq.common.strategy.loading import BUILTIN, check_strategy, strategy_options
from tests.support.strategy_cases import CASES
from tests.support.strategy_specs import digits_spec


def test_every_builtin_strategy_has_a_digits_case_and_every_case_is_a_builtin() -> None:
    missing = sorted(set(BUILTIN) - set(CASES))
    unknown = sorted(set(CASES) - set(BUILTIN))
    assert not missing, f"add a line to tests/support/strategy_cases.py CASES for {missing}"
    assert not unknown, f"CASES has {unknown}, which are not in BUILTIN (common/refs.py)"


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_names_its_own_strategy_and_its_digits_job_is_valid(case: str) -> None:
    assert CASES[case]["name"] == case
    strategy_options(case, CASES[case].get("options", {}))  # ConfigError naming the bad option
    spec = parse_job(digits_spec(case, rounds=2, epochs=1), f"digits with {case}")
    check_strategy(spec)  # its options work with the rest of the job (clients, optimizer)
    assert (spec.strategy.name, spec.rounds, spec.train.epochs, spec.name) == (case, 2, 1, f"digits-{case}")


def test_the_benchmarks_pages_accuracy_table_has_a_row_for_every_case() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    start = page.index("| strategy | options | final accuracy |")
    table = page[start:page.index("\n\n", start)]
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]}
    assert rows == set(CASES), (
        f"docs/benchmarks.md's accuracy table lacks {sorted(set(CASES) - rows)}: rerun "
        "`python benchmarks/all.py --only strategies` (or `make bench`), then "
        "`python benchmarks/report.py --write docs/benchmarks.md`"
    )
