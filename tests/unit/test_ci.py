"""One answer to "are we under CI", for every test that fails there instead of skipping."""

from __future__ import annotations

import pytest

from tests.ci import under_ci


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", "yes", "YES", "Yes", " true "])
def test_ci_set_to_yes_in_any_spelling_means_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    assert under_ci()


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", "2"])
def test_ci_unset_or_set_to_anything_else_means_not_under_ci(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CI", value)
    assert not under_ci()


def test_ci_unset_means_not_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert not under_ci()
