"""Queue and exchange names, shared by both buses.

    fedmq submit ─▶ [fedmq.scheduler] ◀── UpdateAccepted, RoundClosed, ClientFailure
                          │
          JobCreate, RoundOpen, RoundClose ─▶ [fedmq.aggregator] ◀── ClientUpdate
                          │                          ▲
                   TrainTask ─▶ [fedmq.tasks] ─▶ learners ──ModelGet──▶ [fedmq.model]
                          │
                   JobEvent ─▶ (fedmq.events, topic "job.<id>") ─▶ CLI watchers

The aggregator takes control messages and updates from one queue so that a
round's RoundOpen is always handled before its updates and its RoundClose
after the updates the scheduler counted.
"""

SCHEDULER = "fedmq.scheduler"
AGGREGATOR = "fedmq.aggregator"
TASKS = "fedmq.tasks"
MODEL = "fedmq.model"
EVENTS = "fedmq.events"
DEAD_LETTERS = "fedmq.dead"

QUEUES = (SCHEDULER, AGGREGATOR, TASKS, MODEL)


def job_topic(job_id: str) -> str:
    return f"job.{job_id}"
