"""A learner process checks its device before anything else: a bad one never reaches the broker."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from tests.e2e.cluster import Cluster


def test_a_learner_asking_for_a_missing_gpu_exits_before_connecting(tmp_path: Path) -> None:
    missing = f"cuda:{max(7, torch.cuda.device_count())}"  # one past the last GPU, here or anywhere
    with socket.socket() as broker:  # a "broker" that notes every connection and never answers
        broker.bind(("127.0.0.1", 0))
        broker.listen()
        c = Cluster(f"amqp://guest:guest@127.0.0.1:{broker.getsockname()[1]}/", tmp_path)
        proc = c.start("learner", FEDMQ_DEVICE=missing)
        assert proc.wait(timeout=120) == 2
        broker.setblocking(False)
        try:
            broker.accept()[0].close()
            connected = True
        except BlockingIOError:
            connected = False
    log = c.log("learner")
    assert f"FEDMQ_DEVICE={missing}" in log, log
    assert "Traceback" not in log
    assert not connected, "the learner connected to the broker before checking its device"
