"""Queue and exchange names, shared by both buses, and how RabbitMQ declares them.

    fedmq submit ─▶ [fedmq.scheduler] ◀── UpdateAccepted, RoundClosed, ClientFailure
                          │
          JobCreate, RoundOpen, RoundClose ─▶ [fedmq.aggregator] ◀── ClientUpdate
                          │                          ▲
                   TrainTask ─▶ [fedmq.tasks] ─▶ learners ──ModelGet──▶ [fedmq.model]
                          │
                   TrainTask of site S ─▶ [fedmq.site.S] ─▶ the learners hosting S (FEDMQ_SITES)
                          │
                   JobEvent ─▶ (fedmq.events, topic "job.<id>") ─▶ CLI watchers

The aggregator takes control messages and updates from one queue so that a
round's RoundOpen is always handled before its updates and its RoundClose
after the updates the scheduler counted.

On RabbitMQ, nothing goes through the default exchange (write on it reaches every queue):
each destination has a direct exchange of its own, so the broker's write permission on
that exchange says who may send there (deploy/rabbitmq/definitions.json).

    publish(Q) ──▶ fedmq.x.<Q's last word> ──(key Q)──▶ quorum queue Q
                   ──(reject/limit)──▶ fedmq.dlx ──▶ fedmq.dead
    publish_event ──▶ fedmq.events (topic) ──▶ one exclusive queue per subscription
    request ──▶ as publish, reply_to = this bus's exclusive reply queue,
                bound to fedmq.x.reply (written only by the services that answer)
    publish(fedmq.site.S) ──▶ fedmq.x.site ──(key fedmq.site.S)──▶ quorum queue fedmq.site.S
    blob chunks ──▶ fedmq.x.blob ──(key = the blob queue's name)──▶ fedmq.blob.<id>

Every publish carries the sender's broker user in `user_id`, which RabbitMQ checks
against the connection's user; consumers check it against the message type
(common/senders.py). The work queues' bindings are in the definitions; a service that
may bind (the scheduler, or `guest` on a development broker) declares them again at
every connect, and one that may not is refused once and goes on.

A site's queue exists once a learner hosting it or the scheduler declares it; the scheduler
binds it (it may) before its first task for that site, so a site whose learner is down keeps
its task until the learner comes back or the round's deadline passes.

fedmq.dead is bounded by count, bytes and age (FEDMQ_DEAD_LETTER_*); past a bound the
oldest dead letters go first (drop-head), so a flood of bad messages cannot fill the broker.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from fedmq.common.sites import SITE_NAME

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
SITE_PREFIX = "fedmq.site."  # one queue per site: fedmq.site.<name>

# The exchange in front of each work queue: who may write to it is who may send there.
EXCHANGE_PREFIX = "fedmq.x."
EXCHANGES = {queue: EXCHANGE_PREFIX + queue.rsplit(".", 1)[1] for queue in QUEUES}
REPLIES = "fedmq.x.reply"  # replies to requests, keyed by the asker's reply queue
BLOBS = "fedmq.x.blob"  # a large message's chunks, keyed by its blob queue
SITES = "fedmq.x.site"  # every site's tasks, keyed by the site's queue


def site_queue(site: str) -> str:
    """The queue of one site's tasks; ValueError for a name that is not a site's."""
    if not SITE_NAME.match(site):
        raise ValueError(f"{site!r} is not a site name: letters, digits, '-' and '_', at most 64")
    return SITE_PREFIX + site


LEARNER_QUEUE = "learner--"  # a site name no job may use: a learner's own queue


def learner_queue(learner: str) -> str:
    """A learner's own queue (a DDP group's launch and stop), beside the sites' under fedmq.x.site."""
    slug = re.sub(r"[^A-Za-z0-9_-]", "-", learner)[: 64 - len(LEARNER_QUEUE)]
    return site_queue(LEARNER_QUEUE + slug)


def is_site_queue(queue: str) -> bool:
    return queue.startswith(SITE_PREFIX) and bool(SITE_NAME.match(queue[len(SITE_PREFIX):]))


def exchange_for(queue: str) -> str:
    """The exchange a message for `queue` goes through on RabbitMQ."""
    if is_site_queue(queue):
        return SITES
    try:
        return EXCHANGES[queue]
    except KeyError:
        raise ValueError(f"{queue} is not one of fedmq's work queues {QUEUES} nor a site's") from None


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
    for exchange in (*EXCHANGES.values(), REPLIES, BLOBS, SITES):
        ch.exchange_declare(exchange, exchange_type="direct", durable=True)
    ch.queue_declare(DEAD_LETTERS, durable=True, arguments=dead_letter_arguments(settings))
    for name in QUEUES:
        ch.queue_declare(name, durable=True, arguments=work_queue_arguments(settings))


def work_queue_arguments(settings: Settings) -> dict[str, Any]:
    """A work queue's (and a site queue's): quorum, dead-lettered, bounded redeliveries."""
    return {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": DLX,
        "x-delivery-limit": settings.delivery_limit,
    }


def declare_site_queue(ch: BlockingChannel, settings: Settings, queue: str, bind: bool) -> None:
    """A site's queue, and (`bind`: the scheduler, which may) its binding to fedmq.x.site."""
    ch.queue_declare(queue, durable=True, arguments=work_queue_arguments(settings))
    if bind:
        ch.queue_bind(queue, SITES, routing_key=queue)


BINDINGS = ((DEAD_LETTERS, DLX, DEAD_LETTERS), *((queue, EXCHANGES[queue], queue) for queue in QUEUES))


def bind_topology(ch: BlockingChannel) -> bool:
    """Bind each queue to its exchange (queue, exchange, key); False if this user may not.

    Binding needs write on the queue, which only the topology's owner holds: a service without
    it is refused (403, which closes `ch`, a channel of its own) and relies on the bindings the
    definitions made.
    """
    import pika.exceptions

    try:
        for queue, exchange, key in BINDINGS:
            ch.queue_bind(queue, exchange, routing_key=key)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != 403:
            raise
        return False
    return True


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
