"""What the broker allows: a round's messages over raw pika, with no fedmq code and no training.

A round of fedmq over RabbitMQ is a pattern of messages. This script plays that pattern with
bare pika, each role in a process of its own, and times the steady round. No code of fedmq's runs,
nothing is decoded, stored or trained. So no round of fedmq's can be faster than this one on the
same broker and machine: a goal under it is out of reach for the pattern, whatever fedmq does.

    scheduler  RoundOpen and the round's tasks, persistent, in one transaction (one wait): one
               message per learner, holding its share of the clients and the model (pushed)
    learner    per message: its clients' updates published as one message and confirmed, then
               the message acked; prefetch 1, as fedmq's learners take tasks
    aggregator each update acked; after the round's last, RoundClosed to the scheduler,
               persistent and confirmed

Queues are quorum queues, as fedmq's work queues are. A second variant plays the pattern before
fedmq batched tasks and pushed small models: one message a task, and each learner fetching the
model once a round (a persistent request to the model queue, a 20 kB reply on its own queue).

A third variant adds the work the plain loop does, placed as fedmq places it, still with no code
of fedmq's services: each learner trains its clients of the digits job (the plain loop's own
training, `tests/reference.py`, one SGD step each) before it sends their updates, and the
aggregator averages ten models' worth of tensors and writes one fsynced file a round, as any
durable commit must. What it adds to the first variant is what 2 cores shared by six processes
make of the plain loop's work: no fedmq round on this machine is faster than it.

Prints one JSON object: the steady round's median (and p90) in seconds for each variant.
`round_overhead.py` runs the first and the third beside fedmq's own round, in the same run.

Usage: python benchmarks/broker_floor.py [--clients 10] [--learners 3] [--rounds 40]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pika

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the plain loop (tests/reference.py) and the digits Task, for `train`

URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
PERSISTENT = pika.BasicProperties(delivery_mode=2)
UPDATE = b"u" * 2000  # about a digits update's size
MODEL = b"m" * 20000  # about the digits model's
TASK = b"t" * 2000  # about a task's fields and job spec
STEADY_FROM = 3  # the first rounds warm the broker's queues up


def _connect(url: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(url))


def _digits(clients: int) -> tuple[Any, Any, dict[int, Any]]:
    """The digits job's spec (1 SGD step a client), its model, and each client's training data."""
    import torch

    from fedmq.common.jobspec import load_job
    from fedmq.common.task.runtime import TaskRuntime

    torch.set_num_threads(1)  # as fedmq's services run
    spec = load_job(REPO / "examples" / "digits.yaml", {
        "train.max_steps": 1, "clients.total": clients, "clients.per_round": clients,
        "clients.min_fit": clients,
    })
    task = TaskRuntime.for_job(spec)
    return spec, task.build_model(), {k: task.load_data(k, None).train for k in range(clients)}


def _train(trained: tuple[Any, Any, dict[int, Any]], server_round: int, first: int, count: int) -> None:
    """The plain loop's training of clients first .. first + count - 1 from the global weights."""
    from fedmq.common.seeding import torch_generator
    from tests.reference import client_update

    spec, model, data = trained
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for client in range(first, first + count):
        model.load_state_dict(start)
        x, y = data[client]
        client_update(model, x, y, spec.train, torch_generator(spec.seed, "train", server_round, client))
        _ = {k: v.clone() for k, v in model.state_dict().items()}  # the update's copy, as the loop keeps
    model.load_state_dict(start)


def _learner(url: str, q: dict[str, str], fetch: bool, prefetch: int, clients: int, train: bool) -> None:
    trained = _digits(clients) if train else None
    conn = _connect(url)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_qos(prefetch_count=prefetch)
    replies = ch.queue_declare("", exclusive=True).method.queue
    fetched: set[bytes] = set()

    def on_task(_ch: Any, method: Any, _props: Any, body: bytes) -> None:
        server_round = body[:8]
        if fetch and server_round not in fetched:
            asked = uuid.uuid4().hex
            ch.basic_publish("", q["model"], b"get", pika.BasicProperties(
                delivery_mode=2, reply_to=replies, correlation_id=asked))
            while True:  # a consumer's callback cannot wait for another consumer's delivery
                got, props, _ = ch.basic_get(replies, auto_ack=True)
                if got is not None and props.correlation_id == asked:
                    break
            fetched.add(server_round)
        count = body[8:16]  # the message's clients: their updates go as one message
        if trained is not None:
            _train(trained, int(server_round), int(body[16:24]), int(count))
        ch.basic_publish("", q["aggregator"], b"U" + server_round + count + UPDATE * int(count), PERSISTENT)
        ch.basic_ack(method.delivery_tag)

    ch.basic_consume(q["tasks"], on_task)
    ch.start_consuming()


def _aggregator(url: str, q: dict[str, str], clients: int, train: bool, folder: str) -> None:
    model = _digits(clients)[1] if train else None
    conn = _connect(url)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_qos(prefetch_count=8)
    models = conn.channel()
    models.basic_qos(prefetch_count=4)
    counted: dict[bytes, int] = {}

    def on_get(_ch: Any, method: Any, props: Any, _body: bytes) -> None:
        answer = pika.BasicProperties(correlation_id=props.correlation_id)
        models.basic_publish("", props.reply_to, MODEL, answer)
        models.basic_ack(method.delivery_tag)

    def on_message(_ch: Any, method: Any, _props: Any, body: bytes) -> None:
        if body[:1] == b"U":
            server_round = body[1:9]
            counted[server_round] = counted.get(server_round, 0) + int(body[9:17])
            if counted[server_round] == clients:
                if model is not None:
                    _commit(model, clients, folder)
                ch.basic_publish("", q["scheduler"], b"C" + server_round, PERSISTENT)
        ch.basic_ack(method.delivery_tag)

    models.basic_consume(q["model"], on_get)
    ch.basic_consume(q["aggregator"], on_message)
    ch.start_consuming()


def _commit(model: Any, clients: int, folder: str) -> None:
    """A round's fold and commit at their least: the mean of `clients` models' tensors, written to
    one file and fsynced before the round is announced."""
    import torch

    state = model.state_dict()
    mean = {name: torch.stack([t] * clients).mean(0) for name, t in state.items()}
    path = f"{folder}/checkpoint"
    with open(path + ".tmp", "wb") as f:
        for tensor in mean.values():
            f.write(tensor.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _scheduler(
    url: str, q: dict[str, str], clients: int, rounds: int, out: Any, batch: int, fetch: bool
) -> None:
    task = TASK if fetch else TASK + MODEL  # the model pushed with the tasks, or fetched
    conn = _connect(url)
    ch = conn.channel()
    ch.tx_select()
    starts: list[float] = []

    def open_round(server_round: int) -> None:
        starts.append(time.perf_counter())
        key = b"%08d" % server_round
        ch.basic_publish("", q["aggregator"], b"O" + key, PERSISTENT)
        for first in range(0, clients, batch):
            count = b"%08d" % (min(first + batch, clients) - first)
            ch.basic_publish("", q["tasks"], key + count + b"%08d" % first + task, PERSISTENT)
        ch.tx_commit()

    def on_closed(_ch: Any, method: Any, _props: Any, _body: bytes) -> None:
        ch.basic_ack(method.delivery_tag)
        ch.tx_commit()
        if len(starts) >= rounds:
            starts.append(time.perf_counter())
            ch.stop_consuming()
            return
        open_round(len(starts))

    ch.basic_qos(prefetch_count=8)
    ch.basic_consume(q["scheduler"], on_closed)
    open_round(0)
    ch.start_consuming()
    out.put([b - a for a, b in zip(starts, starts[1:], strict=False)][STEADY_FROM:])


def floor(
    url: str, clients: int, learners: int, rounds: int, *, fetch: bool = False, prefetch: int = 1,
    batch: int | None = None, train: bool = False,
) -> dict[str, float]:
    """The steady round of the pattern on fresh quorum queues, in seconds: median and p90. `batch`:
    tasks a message (None: each learner's share, as fedmq's scheduler sends them); `train`: with
    the plain loop's work (the module's docstring)."""
    batch = batch or -(-clients // learners)
    prefix = f"bench.floor.{uuid.uuid4().hex[:8]}"
    q = {role: f"{prefix}.{role}" for role in ("scheduler", "aggregator", "tasks", "model")}
    conn = _connect(url)
    ch = conn.channel()
    for name in q.values():
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
    out: Any = mp.Queue()
    folder = tempfile.mkdtemp(prefix="fedmq-floor-")
    procs = [mp.Process(target=_learner, args=(url, q, fetch, prefetch, clients, train), daemon=True)
             for _ in range(learners)]
    procs.append(mp.Process(target=_aggregator, args=(url, q, clients, train, folder), daemon=True))
    try:
        for proc in procs:
            proc.start()
        time.sleep(3.0 if train else 1.0)  # every consumer in place (torch imported) before the first round
        scheduler = mp.Process(target=_scheduler, args=(url, q, clients, rounds, out, batch, fetch),
                               daemon=True)
        scheduler.start()
        rounds_s = sorted(out.get(timeout=300))
        scheduler.join()
    finally:
        for proc in procs:
            proc.terminate()
        for name in q.values():
            ch.queue_delete(name)
        conn.close()
        shutil.rmtree(folder, ignore_errors=True)
    return {"round_s_median": round(statistics.median(rounds_s), 4),
            "round_s_p90": round(rounds_s[int(0.9 * (len(rounds_s) - 1))], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    report = {
        "clients_per_round": args.clients, "learners": args.learners,
        "fedmq_pattern": floor(args.url, args.clients, args.learners, args.rounds),
        "fedmq_pattern_trained": floor(args.url, args.clients, args.learners, args.rounds, train=True),
        "one_task_a_message_fetched": floor(
            args.url, args.clients, args.learners, args.rounds, fetch=True, batch=1
        ),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
