"""A RabbitMQ connection owned by one thread: its I/O loop, timers, reconnects and the hand-off.

One connection and one confirmed channel, owned by the thread in `run()`.
Other threads never touch pika: they queue work on an outbox and wake the loop
with `add_callback_threadsafe`, the one thread-safe pika call (invariant 8).

    any thread ──call_soon──▶ outbox ──add_callback_threadsafe (wake)──▶ loop thread
    loop: drain outbox ─▶ fire due timers ─▶ process_data_events (≤ 1 s) ─▶ again
          when-idle callbacks waiting: poll without waiting until no delivery came, then run them
          connection lost ─▶ on_lost ─▶ backoff (doubling, capped) ─▶ connect ─▶ on_open

With several broker addresses (a cluster's nodes), `connect` tries them in turn from the
one after the node it last lost, so a dead node is tried last rather than first forever.

Whatever escapes pika once the connection (or its channel) has died is a connection loss,
whatever its type: pika raises ValueError, AssertionError and others from a closed ioloop.
Calls handed to the loop that were waiting for it then fail with ConnectionError.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from fedmq.common.bus.base import Timer
from fedmq.common.bus.topology import bind_topology, declare_topology, refused_queue_advice
from fedmq.common.errors import BrokerUnavailable
from fedmq.common.settings import Settings, redact_url

log = structlog.get_logger("fedmq.bus")

T = TypeVar("T")

# What means "the connection or channel is gone": reconnect. Anything else a handler raises
# (a full disk, a bug) is that message's problem: it is dead-lettered and the service goes on.
PIKA_ERRORS = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.AMQPChannelError,
    pika.exceptions.StreamLostError,
    pika.exceptions.ConnectionWrongStateError,
    pika.exceptions.ChannelWrongStateError,
)
CONNECTION_ERRORS = (*PIKA_ERRORS, ConnectionError)

IDLE_POLLS = 16  # polls for more deliveries before call_when_idle's callbacks run anyway


class _LoopTimer(Timer):
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def connection_parameters(settings: Settings, name: str) -> list[pika.URLParameters]:
    """How to reach each broker node: one attempt per connect (the loop retries), named for the UI.

    A URL that names a user and no password gets FEDMQ_BROKER_PASSWORD(_FILE)'s, read now;
    an amqps URL gets the FEDMQ_TLS_* context, the broker's name checked against the URL's host.
    """
    password = settings.broker_password_value()
    context = None
    nodes = []
    for url in settings.broker_urls:
        parts = urlsplit(url)
        params = pika.URLParameters(_without_password(url) if password is not None else url)
        if password is not None and parts.username is not None:
            params.credentials = pika.PlainCredentials(unquote(parts.username), password)
        if parts.scheme == "amqps":
            context = context or settings.tls_context()
            params.ssl_options = pika.SSLOptions(context, server_hostname=parts.hostname)
        params.heartbeat = settings.heartbeat_s
        params.blocked_connection_timeout = 60
        params.connection_attempts = 1
        params.socket_timeout = 5
        params.client_properties = {"connection_name": name}
        nodes.append(params)
    return nodes


def _without_password(url: str) -> str:
    # pika cannot parse a URL with a user and no password: give it user:x, replaced by the real one.
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:x@{host}")) if at else url


class BrokerConnection:
    """One connection and its confirmed channel; `run()` owns them, the rest is thread-safe."""

    def __init__(
        self, settings: Settings, name: str, *, on_open: Callable[[], None], on_lost: Callable[[], None]
    ) -> None:
        self.settings = settings
        self.name = name
        self.nodes = connection_parameters(settings, name)
        self.node = 0  # the index of the node connected to, or last connected to
        self._first = 0  # the node the next connect tries first
        self.conn: BlockingConnection | None = None
        self.channel: BlockingChannel | None = None  # confirmed: each publish waits for the broker
        self.generation = 0  # one per connection: a delivery from an older one can't be settled
        self.reconnects = 0
        self.running = False
        self._on_open = on_open  # on the loop, after every (re)connect: consume again
        self._on_lost = on_lost  # the connection is about to be dropped
        self._outbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, _LoopTimer, Callable[[], None]]] = []
        self._idle: list[Callable[[], None]] = []  # call_when_idle's, run once deliveries stop coming
        self.delivered = 0  # deliveries handed to consumers (consumers.py counts them)
        self._seq = itertools.count()
        self._thread: int | None = None
        self._waiting: set[Future[Any]] = set()  # run_on_loop calls not yet answered
        self._waiting_lock = threading.Lock()

    def connect(self) -> None:
        """Open the connection on the first node that answers and declare the topology.

        BrokerUnavailable if no node answers, naming every address and what each said.
        """
        urls = self.settings.broker_urls
        self.nodes = connection_parameters(self.settings, self.name)  # a password file read afresh
        failures: list[tuple[str, BaseException]] = []
        for step in range(len(urls)):
            index = (self._first + step) % len(urls)
            try:
                self._open(index)
            except (*CONNECTION_ERRORS, OSError) as exc:
                self.drop()
                failures.append((urls[index], exc))
                continue
            self.generation += 1
            if len(urls) > 1:
                log.info("broker_connected", bus=self.name, node=redact_url(urls[index]))
            return
        raise BrokerUnavailable(unreachable_message(failures))

    def _open(self, index: int) -> None:
        self.node = index
        self.conn = pika.BlockingConnection(self.nodes[index])
        self.channel = self.conn.channel()
        self.channel.confirm_delivery()
        self.channel.add_on_cancel_callback(self._on_cancelled)
        try:
            declare_topology(self.channel, self.settings)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 406:
                raise
            self.drop()  # every node of a cluster would say the same: no use trying the next
            raise BrokerUnavailable(
                f"RabbitMQ at {redact_url(self.settings.broker_urls[index])} refused fedmq's queues: "
                f"{refused_queue_advice(exc.reply_text)}"
            ) from None
        binder = self.conn.channel()  # a refusal closes it, not the main channel
        if bind_topology(binder):
            binder.close()

    @property
    def user(self) -> str:
        """The broker user of the node connected to (or last connected to): every publish's user_id."""
        return str(getattr(self.nodes[self.node].credentials, "username", "") or "")

    def drop(self) -> None:
        """Forget the connection (closing it if it is still open); its deliveries are the broker's again."""
        self._on_lost()
        conn, self.conn, self.channel = self.conn, None, None
        if conn is not None:
            self._first = (self.node + 1) % len(self.nodes)  # a node that failed us is tried last
        if conn is not None and conn.is_open:
            # Closing a broken connection may fail in many ways; it is gone either way.
            with contextlib.suppress(Exception):
                conn.close()
        self._fail_waiting()

    def is_lost(self) -> bool:
        """True once the connection or its channel is closed: nothing more can be done on them."""
        conn, ch = self.conn, self.channel
        return conn is None or not conn.is_open or ch is None or not ch.is_open

    def _fail_waiting(self) -> None:
        """Calls handed to the loop and not yet run will not run on this connection: fail them now."""
        with self._waiting_lock:
            waiting, self._waiting = self._waiting, set()
        for future in waiting:
            if future.cancel():  # not yet running: fn never runs
                continue
            with contextlib.suppress(InvalidStateError):  # already answered
                future.set_exception(ConnectionError(f"bus {self.name}: connection to the broker was lost"))

    def _on_cancelled(self, frame: object) -> None:
        """The broker cancelled a consumer (queue deleted, leader moved): declare and subscribe again."""
        log.warning("consumer_cancelled_by_broker", bus=self.name)
        self.call_later(self.settings.retry_initial_s, self._resubscribe)

    def _resubscribe(self) -> None:
        # Simplest correct answer: a fresh connection re-declares the topology and every consumer.
        raise pika.exceptions.ChannelWrongStateError("consumer cancelled by broker; resubscribing")

    # -- the loop -------------------------------------------------------------

    def run(self) -> None:
        """Serve until `stop()`, reconnecting with a doubling backoff whenever the connection is lost."""
        self._thread = threading.get_ident()
        self.running = True
        backoff = self.settings.retry_initial_s
        try:
            while self.running:
                try:
                    if self.conn is None or not self.conn.is_open:
                        self.connect()
                    self._on_open()
                    backoff = self.settings.retry_initial_s
                    self._loop()
                except Exception as exc:
                    if not isinstance(exc, (BrokerUnavailable, *CONNECTION_ERRORS)) and not self.is_lost():
                        raise  # a bug with the connection alive: not ours to hide
                    self.drop()
                    if not self.running:
                        break
                    self.reconnects += 1
                    log.warning("broker_connection_lost", bus=self.name, error=str(exc)[:300],
                                retry_in_s=round(backoff, 2))
                    self._pause(backoff)
                    backoff = min(backoff * 2, self.settings.retry_max_s)
        finally:
            self.running = False
            self.drop()

    def _loop(self) -> None:
        assert self.conn is not None
        while self.running:
            self._drain_outbox()
            wait = self._fire_due_timers()
            if self.is_lost():  # closed under a callback that caught the error (pika can't say so)
                raise ConnectionError(f"bus {self.name}: connection closed")
            if self._idle:
                self._when_idle()
                continue
            self.conn.process_data_events(time_limit=min(wait, 1.0) if wait is not None else 1.0)
        if self._idle and not self.is_lost():  # stopping: what was left for later still settles,
            self._run_idle()  # without taking in more

    def _when_idle(self) -> None:
        """Take in what has arrived, without waiting, until no delivery comes (at most IDLE_POLLS
        times: a stream of other deliveries must not starve them), then run the idle callbacks."""
        assert self.conn is not None
        for _ in range(IDLE_POLLS):
            seen = self.delivered
            self.conn.process_data_events(time_limit=0)
            if self.delivered == seen:
                break
        self._run_idle()

    def _run_idle(self) -> None:
        while self._idle:  # one at a time: a lost connection leaves the rest for the next one
            self._guarded(self._idle.pop(0), "callback_crashed")

    def call_when_idle(self, callback: Callable[[], None]) -> None:
        """On the loop thread: run `callback` once the deliveries that have arrived are handled."""
        assert self.on_loop(), "call_when_idle is for the loop thread (a handler)"
        self._idle.append(callback)

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.running and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _drain_outbox(self) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._guarded(item, "callback_crashed")

    def _fire_due_timers(self) -> float | None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer, callback = heapq.heappop(self._timers)
            if not timer.cancelled:
                self._guarded(callback, "timer_callback_crashed")
        return max(0.0, self._timers[0][0] - time.monotonic()) if self._timers else None

    def _guarded(self, callback: Callable[[], None], event: str) -> None:
        """Run a callback on the loop; a lost connection propagates (reconnect), a bug is logged."""
        try:
            callback()
        except PIKA_ERRORS:
            raise
        except Exception as exc:
            if self.is_lost():
                raise ConnectionError(f"bus {self.name}: connection lost in a callback: {exc!r}") from exc
            log.exception(event)

    def stop(self) -> None:
        self.running = False
        if not self.on_loop():  # on the loop (a signal handler) the flag is seen within 1 s
            self._wake()

    # -- the hand-off from other threads ----------------------------------------

    def _wake(self) -> None:
        conn = self.conn
        if conn is not None and conn.is_open:
            # Closing under us: the loop notices by itself.
            with contextlib.suppress(Exception):
                conn.add_callback_threadsafe(lambda: None)

    def on_loop(self) -> bool:
        return threading.get_ident() == self._thread

    def call_soon(self, callback: Callable[[], None]) -> None:
        self._outbox.put(callback)
        self._wake()

    def call_soon_quietly(self, callback: Callable[[], None]) -> None:
        """Queued without waking the loop (pika's wake-up takes a lock: not from a signal handler)."""
        self._outbox.put(callback)  # SimpleQueue.put is reentrant

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = _LoopTimer()
        entry = (time.monotonic() + delay, next(self._seq), timer, callback)
        if self.on_loop():
            heapq.heappush(self._timers, entry)
        else:
            self.call_soon(lambda: heapq.heappush(self._timers, entry))
        return timer

    def run_on_loop(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run fn on the bus thread (or here, if this is it, or if no loop runs) and return its result."""
        if self.on_loop():
            return fn()
        if not self.running:
            if self.conn is None or not self.conn.is_open:
                self.connect()
            return fn()
        future: Future[T] = Future()

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return  # timed out, or failed with its connection before it could run
            try:
                result = fn()
            except BaseException as exc:
                if self.is_lost():  # whatever pika raised, the caller should know it as this
                    lost = ConnectionError(f"bus {self.name}: connection to the broker was lost ({exc!r})")
                    lost.__cause__ = exc
                    exc = lost
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                self._forget(future)

        with self._waiting_lock:
            self._waiting.add(future)
        self.call_soon(work)
        try:
            return future.result(timeout=timeout or self.settings.request_timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"bus {self.name}: broker did not take the message in time") from None
        except CancelledError:  # dropped with its connection before the loop ran it
            raise ConnectionError(f"bus {self.name}: connection to the broker was lost") from None
        finally:
            self._forget(future)

    def _forget(self, future: Future[T]) -> None:
        with self._waiting_lock:
            self._waiting.discard(future)


def unreachable_message(failures: list[tuple[str, BaseException]]) -> str:
    """One line naming every broker address tried (passwords hidden), what each said, what to check."""
    def said(exc: BaseException) -> str:
        return (str(exc) or "connection refused or timed out")[:200]

    if len(failures) == 1:
        url, exc = failures[0]
        where = f"RabbitMQ at {redact_url(url)} ({said(exc)})"
    else:
        where = f"any of {len(failures)} RabbitMQ nodes: " + "; ".join(
            f"{redact_url(url)} ({said(exc)})" for url, exc in failures
        )
    advice = (
        f"cannot reach {where}. Is the broker running (rabbitmq-diagnostics ping), and are "
        "FEDMQ_BROKER_URL's host, port, vhost and credentials right?"
    )
    if any(urlsplit(url).scheme == "amqps" for url, _ in failures):
        advice += (
            " For amqps: does FEDMQ_TLS_CA_FILE hold the CA that signed the broker's certificate, does "
            "that certificate name the URL's host, and does the broker accept FEDMQ_TLS_CERT_FILE?"
        )
    return advice
