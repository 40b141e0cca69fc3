"""On a cluster, rounds whose events were lost (a reconnect) still reach the callbacks, in order."""

from __future__ import annotations

from typing import Any

import fedmq
from fedmq.common.messages import StatusReply


class StubRemote:
    """What the scheduler answers about a job whose round 1 and 2 events never arrived."""

    def status(self, what: str, job_id: str) -> StatusReply:
        history = [{"round": r, "metrics": {"server": {"accuracy": r / 10}}} for r in (2, 0, 1)]
        return StatusReply(jobs=[{"status": "completed", "history": history, "model_path": "m"}])


class Rounds(fedmq.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, float | None]] = []

    def on_round_end(self, round: int, record: fedmq.RoundRecord) -> None:
        self.seen.append((round, record.get("server.accuracy")))


def test_rounds_caught_up_from_the_scheduler_reach_the_callbacks_once_in_order() -> None:
    runner = fedmq.Runner("amqp://guest:guest@127.0.0.1:5672/%2F")
    runner._remote = StubRemote()  # type: ignore[assignment]
    hooks = Rounds()
    history: dict[int, dict[str, Any]] = {0: {"round": 0, "metrics": {}}}  # round 0's event came
    final = runner._catch_up("job-1", history, [hooks])
    assert final["status"] == "completed" and sorted(history) == [0, 1, 2]
    assert hooks.seen == [(1, 0.1), (2, 0.2)]
