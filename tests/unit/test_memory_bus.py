"""The in-memory bus: acks, prefetch, round-robin, dead letters, redelivery, RPC, timers, events."""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from fedmq.common.bus.base import Delivery, topic_matches
from fedmq.common.bus.memory import DeadLetter, MemoryBroker, MemoryBus

WAIT = 5.0  # generous upper bound for anything that should happen at once
Q = "work"


class Buses:
    """Starts MemoryBuses on daemon threads and stops and joins them all at the end."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker
        self.threads: dict[MemoryBus, threading.Thread] = {}

    def start(self, name: str = "bus") -> MemoryBus:
        bus = self.broker.connect()
        thread = threading.Thread(target=bus.run, name=f"test-{name}", daemon=True)
        thread.start()
        self.threads[bus] = thread
        return bus

    def stop(self, bus: MemoryBus) -> None:
        bus.stop()
        assert bus.wait_stopped(WAIT), "bus did not stop"
        self.threads[bus].join(WAIT)
        assert not self.threads[bus].is_alive()

    def close(self) -> None:
        for bus in self.threads:
            bus.stop()
        for thread in self.threads.values():
            thread.join(WAIT)
        alive = [t.name for t in self.threads.values() if t.is_alive()]
        assert not alive, f"bus threads still running: {alive}"


@pytest.fixture
def broker() -> MemoryBroker:
    return MemoryBroker()


@pytest.fixture
def buses(broker: MemoryBroker) -> Iterator[Buses]:
    started = Buses(broker)
    yield started
    started.close()


def drain(bus: MemoryBus) -> None:
    """Wait until everything already queued on the bus's dispatch thread has run."""
    done = threading.Event()
    bus.call_soon(done.set)
    assert done.wait(WAIT), "bus thread did not get to the marker"


def collect(into: queue.Queue[Delivery], *, ack: bool = False) -> Callable[[Delivery], None]:
    def handler(delivery: Delivery) -> None:
        if ack:
            delivery.ack()
        into.put(delivery)

    return handler


def take(deliveries: queue.Queue[Delivery]) -> Delivery:
    return deliveries.get(timeout=WAIT)


# --- publish, consume, ack ------------------------------------------------------------------


def test_a_published_message_is_delivered_and_forgotten_once_acked(
    buses: Buses, broker: MemoryBroker
) -> None:
    bus = buses.start()
    got: queue.Queue[Delivery] = queue.Queue()
    bus.consume(Q, collect(got))
    bus.publish(Q, b"hello", headers={"attempt": 1}, correlation_id="c-1")

    delivery = take(got)
    assert (delivery.body, delivery.queue, delivery.redelivered) == (b"hello", Q, False)
    assert delivery.headers == {"attempt": 1}
    assert delivery.correlation_id == "c-1"
    assert broker.depth(Q) == 1, "an unacked message still counts"
    delivery.ack()
    assert broker.depth(Q) == 0
    assert broker.dead_letters == []


def test_messages_published_before_anyone_consumes_wait_in_the_queue(
    buses: Buses, broker: MemoryBroker
) -> None:
    bus = buses.start()
    for body in (b"1", b"2", b"3"):
        bus.publish(Q, body)
    assert broker.depth(Q) == 3
    got: queue.Queue[Delivery] = queue.Queue()
    bus.consume(Q, collect(got, ack=True), prefetch=10)
    assert [take(got).body for _ in range(3)] == [b"1", b"2", b"3"]


def test_the_handler_runs_on_the_bus_thread(buses: Buses) -> None:
    bus = buses.start("owner")
    seen: queue.Queue[str] = queue.Queue()

    def handler(delivery: Delivery) -> None:
        seen.put(threading.current_thread().name)
        delivery.ack()

    bus.consume(Q, handler)
    bus.publish(Q, b"x")
    assert seen.get(timeout=WAIT) == "test-owner"


def test_acking_twice_is_harmless(buses: Buses, broker: MemoryBroker) -> None:
    bus = buses.start()
    got: queue.Queue[Delivery] = queue.Queue()
    bus.consume(Q, collect(got))
    bus.publish(Q, b"x")
    delivery = take(got)
    delivery.ack()
    delivery.ack()
    delivery.reject("too late")
    assert broker.depth(Q) == 0
    assert broker.dead_letters == []


@pytest.mark.parametrize("body", ["text", bytearray(b"x"), None, 5], ids=type)
def test_publishing_a_body_that_is_not_bytes_is_a_type_error(buses: Buses, body: object) -> None:
    bus = buses.start()
    with pytest.raises(TypeError, match="bytes"):
        bus.publish(Q, body)  # type: ignore[arg-type]


# --- prefetch and round-robin ---------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetch_limits_unacked_deliveries_per_consumer(buses: Buses, prefetch: int) -> None:
    bus = buses.start()
    got: queue.Queue[Delivery] = queue.Queue()
    bus.consume(Q, collect(got), prefetch=prefetch)
    for i in range(prefetch + 1):
        bus.publish(Q, b"%d" % i)

    first = [take(got) for _ in range(prefetch)]
    drain(bus)
    assert got.empty(), f"only {prefetch} may be unacked at once"

    first[0].ack()
    assert take(got).body == b"%d" % prefetch


def test_an_acked_message_frees_its_slot_for_the_next_one(buses: Buses) -> None:
    bus = buses.start()
    acked_first = threading.Event()
    got: queue.Queue[Delivery] = queue.Queue()

    def handler(delivery: Delivery) -> None:
        got.put(delivery)
        if delivery.body == b"first":
            acked_first.wait(WAIT)  # the second cannot be dispatched while this one is unacked
        delivery.ack()

    bus.consume(Q, handler, prefetch=1)
    bus.publish(Q, b"first")
    bus.publish(Q, b"second")
    assert take(got).body == b"first"
    acked_first.set()
    assert take(got).body == b"second"


def test_messages_alternate_between_two_consumers(buses: Buses) -> None:
    got: queue.Queue[tuple[str, bytes]] = queue.Queue()

    def handler_for(name: str) -> Callable[[Delivery], None]:
        def handler(delivery: Delivery) -> None:
            got.put((name, delivery.body))
            delivery.ack()

        return handler

    a, b = buses.start("a"), buses.start("b")
    a.consume(Q, handler_for("a"), prefetch=10)
    b.consume(Q, handler_for("b"), prefetch=10)
    for i in range(6):
        a.publish(Q, b"%d" % i)

    received = sorted(got.get(timeout=WAIT) for _ in range(6))
    assert [body for name, body in received if name == "a"] == [b"0", b"2", b"4"]
    assert [body for name, body in received if name == "b"] == [b"1", b"3", b"5"]


def test_a_full_consumer_is_skipped_in_favour_of_one_with_room(buses: Buses) -> None:
    a_got: queue.Queue[Delivery] = queue.Queue()
    b_got: queue.Queue[Delivery] = queue.Queue()
    a, b = buses.start("a"), buses.start("b")
    a.consume(Q, collect(a_got), prefetch=1)  # never acks
    b.consume(Q, collect(b_got, ack=True), prefetch=1)
    for i in range(4):
        a.publish(Q, b"%d" % i)
    assert take(a_got).body == b"0"
    assert [take(b_got).body for _ in range(3)] == [b"1", b"2", b"3"]


# --- dead letters and redelivery ------------------------------------------------------------


def test_a_rejected_message_is_dead_lettered_with_the_reason(buses: Buses, broker: MemoryBroker) -> None:
    bus = buses.start()
    got: queue.Queue[Delivery] = queue.Queue()
    bus.consume(Q, collect(got))
    bus.publish(Q, b"bad")
    take(got).reject("decode_error: not msgpack")
    assert broker.dead_letters == [DeadLetter(Q, b"bad", "decode_error: not msgpack")]
    assert broker.depth(Q) == 0


def test_stopping_a_bus_redelivers_its_unacked_message_to_another_consumer(
    buses: Buses, broker: MemoryBroker
) -> None:
    first, second = buses.start("first"), buses.start("second")
    first_got: queue.Queue[Delivery] = queue.Queue()
    second_got: queue.Queue[Delivery] = queue.Queue()
    first.consume(Q, collect(first_got))
    first.publish(Q, b"task")
    original = take(first_got)
    assert not original.redelivered
    second.consume(Q, collect(second_got, ack=True))

    buses.stop(first)

    again = take(second_got)
    assert (again.body, again.redelivered) == (b"task", True)
    original.ack()  # a late ack from the stopped consumer changes nothing
    assert broker.depth(Q) == 0
    assert broker.dead_letters == []


def test_a_stopped_bus_gives_its_unacked_messages_back_in_their_order(buses: Buses) -> None:
    # The aggregator holds up to 8 unacked (a group commit): a Ctrl-C pause must keep their order.
    first = buses.start("first")
    first_got: queue.Queue[Delivery] = queue.Queue()
    first.consume(Q, collect(first_got), prefetch=8)
    for i in range(8):
        first.publish(Q, f"m{i}".encode())
    assert [take(first_got).body for _ in range(8)] == [f"m{i}".encode() for i in range(8)]
    buses.stop(first)
    second = buses.start("second")
    second_got: queue.Queue[Delivery] = queue.Queue()
    second.consume(Q, collect(second_got, ack=True), prefetch=8)
    assert [take(second_got).body for _ in range(8)] == [f"m{i}".encode() for i in range(8)]


def test_work_left_for_when_idle_is_done_before_the_bus_stops(buses: Buses, broker: MemoryBroker) -> None:
    bus = buses.start()
    got: queue.Queue[Delivery] = queue.Queue()
    stopping = threading.Event()

    def handle(delivery: Delivery) -> None:
        bus.call_when_idle(delivery.ack)  # settled later, with whatever comes with it
        got.put(delivery)
        assert stopping.wait(WAIT)  # the bus is told to stop before it is ever idle

    bus.consume(Q, handle)
    bus.publish(Q, b"x")
    delivery = take(got)
    bus.stop()
    stopping.set()
    assert bus.wait_stopped(WAIT)
    assert broker.depth(Q) == 0 and not delivery.live(), "acked before the bus stopped"


def test_a_requeued_message_is_delivered_again_marked_redelivered(buses: Buses) -> None:
    bus = buses.start()
    got: queue.Queue[Delivery] = queue.Queue()
    bus.consume(Q, collect(got))
    bus.publish(Q, b"x")
    take(got).requeue()
    again = take(got)
    assert (again.body, again.redelivered) == (b"x", True)
    again.ack()


def test_a_message_delivered_too_often_is_dead_lettered_as_delivery_limit() -> None:
    broker = MemoryBroker(delivery_limit=3)
    local = Buses(broker)
    try:
        bus = local.start()
        deliveries: list[bool] = []
        limit_reached = threading.Event()

        def handler(delivery: Delivery) -> None:
            deliveries.append(delivery.redelivered)
            delivery.requeue()
            if broker.dead_letters:
                limit_reached.set()

        bus.consume(Q, handler)
        bus.publish(Q, b"poison")
        assert limit_reached.wait(WAIT)
        drain(bus)
        assert deliveries == [False, True, True], "delivered exactly delivery_limit times"
        assert broker.dead_letters == [DeadLetter(Q, b"poison", "delivery_limit")]
        assert broker.depth(Q) == 0
    finally:
        local.close()


def test_a_handler_that_raises_is_dead_lettered_and_the_bus_keeps_dispatching(
    buses: Buses, broker: MemoryBroker
) -> None:
    bus = buses.start()
    handled: queue.Queue[bytes] = queue.Queue()

    def handler(delivery: Delivery) -> None:
        if delivery.body == b"boom":
            raise ValueError("bad input")
        delivery.ack()
        handled.put(delivery.body)

    bus.consume(Q, handler)
    bus.publish(Q, b"boom")
    bus.publish(Q, b"fine")
    assert handled.get(timeout=WAIT) == b"fine"
    assert len(broker.dead_letters) == 1
    letter = broker.dead_letters[0]
    assert (letter.queue, letter.body) == (Q, b"boom")
    assert letter.reason.startswith("handler_error")
    assert "ValueError" in letter.reason


# --- request/reply ---------------------------------------------------------------------------


def test_request_returns_the_reply_of_the_consumer(buses: Buses) -> None:
    server, client = buses.start("server"), buses.start("client")

    def answer(delivery: Delivery) -> None:
        server.reply(delivery, delivery.body.upper())
        delivery.ack()

    server.consume("rpc", answer)
    assert client.request("rpc", b"ping", timeout=WAIT) == b"PING"
    assert client.request("rpc", b"again", timeout=WAIT) == b"AGAIN"


def test_concurrent_requests_each_get_their_own_reply(buses: Buses) -> None:
    server = buses.start("server")

    def answer(delivery: Delivery) -> None:
        server.reply(delivery, b"re:" + delivery.body)
        delivery.ack()

    server.consume("rpc", answer, prefetch=8)
    replies: dict[int, bytes] = {}

    def ask(i: int) -> None:
        replies[i] = server.request("rpc", b"%d" % i, timeout=WAIT)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert replies == {i: b"re:%d" % i for i in range(8)}


def test_request_times_out_when_nobody_answers(buses: Buses, broker: MemoryBroker) -> None:
    client = buses.start()
    with pytest.raises(TimeoutError, match="no reply from nobody"):
        client.request("nobody", b"hello?", timeout=0.05)
    assert broker.depth("nobody") == 1, "the request itself stays queued"


def test_a_reply_that_comes_after_the_timeout_is_dropped(buses: Buses, broker: MemoryBroker) -> None:
    client = buses.start()
    with pytest.raises(TimeoutError):
        client.request("slow", b"hello?", timeout=0.05)
    late = buses.start("late")
    answered = threading.Event()

    def answer(delivery: Delivery) -> None:
        late.reply(delivery, b"too late")
        delivery.ack()
        answered.set()

    late.consume("slow", answer)
    assert answered.wait(WAIT)
    drain(late)
    assert not [name for name in broker._queues if name.startswith("reply.") and broker.depth(name)]


# --- timers and call_soon --------------------------------------------------------------------


def test_call_later_runs_on_the_bus_thread_after_the_delay(buses: Buses) -> None:
    bus = buses.start("timers")
    ran: queue.Queue[tuple[str, float]] = queue.Queue()
    start = time.monotonic()
    bus.call_later(0.05, lambda: ran.put((threading.current_thread().name, time.monotonic())))
    thread_name, at = ran.get(timeout=WAIT)
    assert thread_name == "test-timers"
    assert at - start >= 0.05


def test_a_cancelled_timer_never_runs(buses: Buses) -> None:
    bus = buses.start()
    ran: list[str] = []
    later_done = threading.Event()
    timer = bus.call_later(0.02, lambda: ran.append("cancelled"))
    timer.cancel()

    def kept() -> None:
        ran.append("kept")
        later_done.set()

    bus.call_later(0.05, kept)
    assert later_done.wait(WAIT)
    assert ran == ["kept"], "timers fire in deadline order, so the earlier one would be first"


def test_timers_fire_in_deadline_order_not_scheduling_order(buses: Buses) -> None:
    bus = buses.start()
    ran: list[float] = []
    done = threading.Event()
    for delay in (0.06, 0.02, 0.04):
        bus.call_later(delay, functools.partial(ran.append, delay))
    bus.call_later(0.08, done.set)
    assert done.wait(WAIT)
    assert ran == [0.02, 0.04, 0.06]


def test_a_timer_that_raises_does_not_stop_the_bus(buses: Buses) -> None:
    bus = buses.start()
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("timer bug")

    bus.call_later(0.0, boom)
    bus.call_later(0.01, done.set)
    assert done.wait(WAIT)


# --- events ----------------------------------------------------------------------------------


def test_subscribers_receive_events_whose_topic_matches_their_pattern(buses: Buses) -> None:
    publisher, watcher = buses.start("publisher"), buses.start("watcher")
    got: dict[str, list[bytes]] = {"job.*": [], "job.#": [], "other.*": [], "#": []}
    for pattern, bodies in got.items():
        watcher.subscribe(pattern, bodies.append)

    publisher.publish_event("job.abc", b"one")
    publisher.publish_event("job.abc.round", b"two")
    publisher.publish_event("elsewhere", b"three")
    drain(watcher)

    assert got == {
        "job.*": [b"one"],
        "job.#": [b"one", b"two"],
        "other.*": [],
        "#": [b"one", b"two", b"three"],
    }


@pytest.mark.parametrize(
    ("pattern", "topic", "matches"),
    [
        ("job.abc", "job.abc", True),
        ("job.abc", "job.abd", False),
        ("job.*", "job.abc", True),
        ("job.*", "job", False),
        ("job.*", "job.abc.round", False),
        ("*.abc", "job.abc", True),
        ("*", "job", True),
        ("*", "job.abc", False),
        ("job.#", "job", True),
        ("job.#", "job.abc", True),
        ("job.#", "job.abc.round.3", True),
        ("job.#", "jobs.abc", False),
        ("#", "anything.at.all", True),
        ("#.round", "job.abc.round", True),
        ("#.round", "round", True),
        ("#.round", "job.abc.rounds", False),
        ("job.#.done", "job.done", True),
        ("job.#.done", "job.a.b.done", True),
        ("job.#.done", "job.a.b.done.x", False),
        ("job.*.#", "job", False),
        ("job.*.#", "job.abc", True),
        ("job.abc", "job.abc.extra", False),
    ],
)
def test_topic_matches_follows_amqp_topic_rules(pattern: str, topic: str, matches: bool) -> None:
    assert topic_matches(pattern, topic) is matches
