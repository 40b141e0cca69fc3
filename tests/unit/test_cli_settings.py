"""The CLI warns of FEDMQ_ variables that are no setting, and takes the broker from --broker-url."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fedmq.services.cli.app import unknown_settings
from fedmq.services.cli.main import app


def test_a_misspelled_setting_is_named_with_the_one_meant() -> None:
    lines = unknown_settings({"FEDMQ_BROKR_URL": "x", "FEDMQ_DEVICE": "cpu", "FEDMQ_ZZZ": "1", "HOME": "/"})
    assert lines == ["FEDMQ_BROKR_URL is not a fedmq setting: did you mean FEDMQ_BROKER_URL?",
                     "FEDMQ_ZZZ is not a fedmq setting"]


def test_broker_url_option_reaches_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDMQ_BROKER_URL", raising=False)
    monkeypatch.setenv("FEDMQ_BROKR_URL", "amqp://typo")
    result = CliRunner().invoke(app, ["--broker-url", "amqp://guest:guest@127.0.0.1:1/none", "learners"])
    assert result.exit_code == 3, result.output  # unreachable: the option's broker was the one tried
    assert "127.0.0.1:1/none" in result.output and "did you mean FEDMQ_BROKER_URL?" in result.output
