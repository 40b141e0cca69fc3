"""The one wrapper around calls into user code, and how its errors read."""

from __future__ import annotations

import sys

import pytest

from fedmq.common.errors import ConfigError, StateUnwritable
from fedmq.common.usercode import MESSAGE_CHARS, UserCodeError, user_code


def test_anything_user_code_raises_comes_out_naming_phase_type_and_message() -> None:
    with pytest.raises(UserCodeError) as caught, user_code("train", round=3, client=7):
        raise KeyError("shard 9")
    exc = caught.value
    got = (exc.phase, exc.error_type, exc.message, exc.round, exc.client)
    assert got == ("train", "KeyError", "'shard 9'", 3, 7)
    assert isinstance(exc.__cause__, KeyError), "the traceback is kept for the log"


def test_fedmqs_own_check_of_what_user_code_returned_counts_as_user_code() -> None:
    with pytest.raises(UserCodeError) as caught, user_code("build_model"):
        raise ConfigError("model 'x' must map (B, 4) to (B, 3) logits, got (2, 5)")
    assert caught.value.error_type == "ConfigError"


def test_a_users_sys_exit_is_caught_so_it_cannot_end_a_thread() -> None:
    with pytest.raises(UserCodeError) as caught, user_code("load_data"):
        sys.exit(3)
    assert caught.value.error_type == "SystemExit"


def test_a_state_write_failing_inside_is_not_blamed_on_the_user() -> None:
    with pytest.raises(StateUnwritable), user_code("evaluate"):
        raise StateUnwritable("/state/x", 28, "No space left on device")


def test_a_huge_message_is_cut() -> None:
    with pytest.raises(UserCodeError) as caught, user_code("train"):
        raise ValueError("x" * 10 * MESSAGE_CHARS)
    assert len(caught.value.message) == MESSAGE_CHARS


def test_the_error_line_says_where_and_what() -> None:
    exc = UserCodeError("train", "RuntimeError", "CUDA error", round=2)
    line = exc.info("learner", round=5, client=4, learner="gpu-node/1").line()
    where = "(round 2, client 4, on gpu-node/1)"  # the error's own round wins over the caller's
    assert line == f"user code failed in learner train {where}: RuntimeError: CUDA error"
    assert exc.info("aggregator").line() == (
        "user code failed in aggregator train (round 2): RuntimeError: CUDA error"
    )
