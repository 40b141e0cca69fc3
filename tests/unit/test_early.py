"""EarlyReads without a broker: what its thread does with no connection, and a claim of a read
whose chunks are on their way back."""

from __future__ import annotations

import threading
import time

import pytest

from fedmq.common.bus import early
from fedmq.common.bus.blob import BLOB_PREFIX, H_BLOB, H_COUNT, H_DIGEST, H_SIZE

BLOB = f"{BLOB_PREFIX}0123"
NOTICE: dict[str, object] = {H_BLOB: BLOB, H_COUNT: 2, H_SIZE: 100}


def test_with_reads_and_no_connection_the_thread_waits_instead_of_spinning(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = early.EarlyReads(lambda: None, max_bytes=1000, name="t")  # the bus is not connected
    ticks = 0
    expire = early.EarlyReads._expire

    def counted(self: early.EarlyReads) -> None:
        nonlocal ticks
        ticks += 1
        expire(self)

    monkeypatch.setattr(early.EarlyReads, "_expire", counted)
    reads.start(NOTICE, None, sync=False)  # fails to begin (no connection), kept FAILED_S
    time.sleep(0.5)
    try:
        assert BLOB in reads._reads, "the failed read is still remembered"
        assert ticks < 50, f"{ticks} turns of the loop in half a second: it spins"
    finally:
        reads.stop()


def test_a_read_being_given_back_is_never_claimed_and_not_waited_for() -> None:
    reads = early.EarlyReads(lambda: None, max_bytes=1000, name="t")
    read = early._Read(BLOB, 2, 100, None, False, closing=True)
    reads._reads[read.blob] = read
    waited: list[float | None] = []

    class Watched(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waited.append(timeout)
            return super().wait(0)

    read.ended = Watched()
    assert reads.claim({**NOTICE, H_DIGEST: read.digest.hexdigest()}) == (None, True)
    assert waited == [], "no wait for a read that can never be handed over"
