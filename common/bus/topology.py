"""Queue and exchange names, shared by both buses, and how RabbitMQ declares them.

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

On RabbitMQ:

    publish ──▶ default exchange ──▶ quorum queue ──(reject/limit)──▶ fedmq.dlx ──▶ fedmq.dead
    publish_event ──▶ fedmq.events (topic) ──▶ one exclusive queue per subscription
    request ──▶ queue, reply_to = this bus's exclusive reply queue
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the in-memory bus imports these names without pika or settings
    from pika.adapters.blocking_connection import BlockingChannel

    from fedmq.common.settings import Settings

SCHEDULER = "fedmq.scheduler"
AGGREGATOR = "fedmq.aggregator"
TASKS = "fedmq.tasks"
MODEL = "fedmq.model"
EVENTS = "fedmq.events"
DEAD_LETTERS = "fedmq.dead"
DLX = "fedmq.dlx"

QUEUES = (SCHEDULER, AGGREGATOR, TASKS, MODEL)


def job_topic(job_id: str) -> str:
    return f"job.{job_id}"


def declare_topology(ch: BlockingChannel, settings: Settings) -> None:
    """Exchanges and queues every service needs; idempotent, run at every (re)connect."""
    ch.exchange_declare(EVENTS, exchange_type="topic", durable=True)
    ch.exchange_declare(DLX, exchange_type="fanout", durable=True)
    ch.queue_declare(DEAD_LETTERS, durable=True, arguments={"x-queue-type": "quorum"})
    ch.queue_bind(DEAD_LETTERS, DLX)
    arguments = {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": DLX,
        "x-delivery-limit": settings.delivery_limit,
    }
    for name in QUEUES:
        ch.queue_declare(name, durable=True, arguments=arguments)
