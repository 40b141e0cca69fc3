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

fedmq.dead is bounded by count, bytes and age (FEDMQ_DEAD_LETTER_*); past a bound the
oldest dead letters go first (drop-head), so a flood of bad messages cannot fill the broker.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

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


# The setting behind each queue argument fedmq sets: named when a queue exists with another value.
ARGUMENT_SETTINGS = {
    "x-delivery-limit": "FEDMQ_DELIVERY_LIMIT",
    "x-max-length": "FEDMQ_DEAD_LETTER_MAX_COUNT",
    "x-max-length-bytes": "FEDMQ_DEAD_LETTER_MAX_BYTES",
    "x-message-ttl": "FEDMQ_DEAD_LETTER_TTL_S",
}
_INEQUIVALENT = re.compile(r"inequivalent arg '([^']+)' for queue '([^']+)' in vhost '([^']*)'")


def dead_letter_arguments(settings: Settings) -> dict[str, Any]:
    """fedmq.dead's bounds: count, bytes and age; past one, the oldest dead letters are dropped."""
    return {
        "x-queue-type": "quorum",
        "x-max-length": settings.dead_letter_max_count,
        "x-max-length-bytes": settings.dead_letter_max_bytes,
        "x-overflow": "drop-head",
        "x-message-ttl": settings.dead_letter_ttl_s * 1000,
    }


def declare_topology(ch: BlockingChannel, settings: Settings) -> None:
    """Exchanges and queues every service needs; idempotent, run at every (re)connect."""
    ch.exchange_declare(EVENTS, exchange_type="topic", durable=True)
    ch.exchange_declare(DLX, exchange_type="fanout", durable=True)
    ch.queue_declare(DEAD_LETTERS, durable=True, arguments=dead_letter_arguments(settings))
    ch.queue_bind(DEAD_LETTERS, DLX)
    arguments = {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": DLX,
        "x-delivery-limit": settings.delivery_limit,
    }
    for name in QUEUES:
        ch.queue_declare(name, durable=True, arguments=arguments)


def refused_queue_advice(reply_text: str) -> str:
    """What to do when RabbitMQ refuses a queue as declared (406): the queue, argument and setting."""
    found = _INEQUIVALENT.search(reply_text)
    if found is None:
        return f"{reply_text}. A queue of fedmq's exists with other arguments: delete it or use a new vhost."
    argument, queue, vhost = found.groups()
    setting = ARGUMENT_SETTINGS.get(argument)
    if "current is none" in reply_text:  # the queue has no such bound: no value to match
        setting = None
    return (
        f"queue {queue} exists with another {argument} than this service asks for ({reply_text}). "
        f"Delete it and fedmq declares it anew: rabbitmqctl delete_queue -p {vhost} {queue} "
        "(the messages in it are lost)"
        + (f"; or set {setting} to the value the queue has." if setting else ".")
    )
