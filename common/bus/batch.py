"""Small messages published together: one transaction on a channel of its own, one wait.

A confirmed channel makes each publish wait for the broker (a quorum queue's confirm: its
log written and fsynced), so a round's RoundOpen and ten tasks were eleven waits in a row.
A transaction sends them back to back and waits once: RabbitMQ answers tx.commit once every
message in it is enqueued and persisted, as confirms would, and sends back (basic.return)
each mandatory one no queue took before that answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection, ReturnedMessage


class BatchPublisher:
    """Publishes a list of small messages in one transaction; on the connection's loop thread only."""

    def __init__(self, connection: Callable[[], BlockingConnection | None]) -> None:
        self._connection = connection  # the bus's current connection, None while it has none
        self._ch: BlockingChannel | None = None
        self._returned: list[ReturnedMessage] = []

    def forget(self) -> None:
        """The connection is gone, and this channel with it."""
        self._ch = None

    def publish(self, messages: Sequence[tuple[str, str, bytes]], props: pika.BasicProperties) -> None:
        """Publish each (exchange, routing key, body), mandatory, then commit them all.

        UnroutableError (after the commit: the others are sent) when a queue took none of one."""
        ch = self._channel()
        self._returned.clear()
        try:
            for exchange, key, body in messages:
                ch.basic_publish(exchange, key, body, props, mandatory=True)
            ch.tx_commit()
        except BaseException:
            if ch.is_open:  # nothing half-sent left for the next batch's commit
                ch.tx_rollback()
            raise
        if self._returned:
            returned, self._returned = self._returned, []
            raise pika.exceptions.UnroutableError(returned)

    def _channel(self) -> BlockingChannel:
        if self._ch is None or not self._ch.is_open:
            conn = self._connection()
            if conn is None:
                raise pika.exceptions.ChannelWrongStateError("not connected")
            ch = conn.channel()
            ch.tx_select()
            # The returns come before commit-ok, on the underlying channel at once; BlockingChannel's
            # own callback would only queue them for the next dispatch of every consumer.
            ch._impl.add_on_return_callback(self._on_return)
            self._ch = ch
        return self._ch

    def _on_return(self, _channel: Any, method: Any, properties: Any, body: bytes) -> None:
        self._returned.append(ReturnedMessage(method, properties, body))
