"""Cross-silo sites on a real broker loaded with deploy/rabbitmq's definitions (issues 14, 15).

Two learners, each its own broker user, each hosting two sites whose data files only it has.
A job over the four sites completes bit for bit as the undisturbed run in one process, though
an update one site's learner forges for another's site is sent meanwhile (refused by the
aggregator and counted); every task reached a learner hosting its site; once a learner stops,
a second job runs with its sites dropped from each round (`no_site_learner`) and ends as the
one-process run hosting only the other learner's sites.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pika
import pika.exceptions
import pytest

from examples.sites import write_sites
from fedmq.common.bus import topology
from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import load_job
from fedmq.common.messages import ClientUpdate, to_wire
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import REPO, assert_bit_identical
from tests.e2e.cluster import Cluster
from tests.rabbit import deployed_vhost

pytestmark = pytest.mark.rabbitmq

SITES = ["hospital-a", "hospital-b", "hospital-c", "hospital-d"]
HOSTS = {"learner-0": SITES[:2], "learner-1": SITES[2:]}
ROUNDS = 3


def _spec(tmp_path: Path) -> Path:
    spec = tmp_path / "sites.yaml"
    spec.write_text(
        (REPO / "examples" / "sites.yaml").read_text()
        .replace("rounds: 10", f"rounds: {ROUNDS}").replace("round_timeout_s: 60", "round_timeout_s: 15")
    )
    return spec


def _add_site_user(vhost: str, name: str, password: str, like: str, sites: list[str]) -> None:
    """A site's own learner user: the deployed learner's permissions, narrowed to its sites' queues
    (configure and read), as docs/security.md tells an operator to do."""
    rows = subprocess.run(["rabbitmqctl", "-q", "list_permissions", "-p", vhost], capture_output=True,
                          text=True, check=True, timeout=60).stdout.splitlines()
    perms = next(line.split("\t")[1:4] for line in rows if line.split("\t")[0] == like)
    own = "fedmq\\.site\\.(" + "|".join([*sites, "learner--.+"]) + ")"  # its sites', its own queue
    perms = [perm.replace("fedmq\\.site\\..+", own) for perm in perms]
    assert all(own in perm for perm in (perms[0], perms[2])), perms
    for args in (("add_user", name, password), ("set_permissions", "-p", vhost, name, *perms)):
        subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, check=True, timeout=60)


def _trained_sites(log: str) -> list[str]:
    return [json.loads(line)["site"] for line in log.splitlines()
            if line.startswith("{") and '"task_trained"' in line]


def _embedded(spec: Path, data: Path, state: Path, sites: list[str] | None = None) -> dict:
    """The undisturbed run in one process, every site's file in one folder (or only `sites` hosted)."""
    settings = Settings(state_dir=state, data_dir=data, sites=",".join(sites or []))
    return run_job(load_job(spec), settings)


def test_sites_go_only_to_their_learners_and_drop_out_when_it_stops(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    write_sites(tmp_path / "all-data", SITES)
    with deployed_vhost() as deployed:
        second = f"{deployed.names['learner']}-2"
        _add_site_user(deployed.vhost, second, "site-pass-2", deployed.names["learner"], HOSTS["learner-1"])
        users = {"learner-0": deployed.names["learner"], "learner-1": second}
        site_users = ",".join(f"{site}:{users[name]}" for name, sites in HOSTS.items() for site in sites)
        env = {**deployed.role_env(), "FEDMQ_LEARNER_USERS": ",".join(users.values()),
               "FEDMQ_SITE_USERS": site_users}
        c = Cluster(deployed.url("cli"), tmp_path, env)
        try:
            for service in ("scheduler", "aggregator"):
                c.start(service, FEDMQ_BROKER_URL=deployed.url(service))
            for name, sites in HOSTS.items():
                data = tmp_path / f"data-{name}"
                write_sites(data, sites, all_sites=SITES)  # this machine holds its own sites' files only
                url = deployed.url("learner") if name == "learner-0" else (
                    f"amqp://{second}:site-pass-2@{deployed.where}/{deployed.vhost}")
                c.start("learner", name, FEDMQ_BROKER_URL=url, FEDMQ_SITES=",".join(sites),
                        FEDMQ_DATA_DIR=str(data), FEDMQ_REPLICA=name[-1])
            rows = c.wait_learners(2, timeout=90)
            assert sorted(s for row in rows for s in row["sites"]) == SITES
            # The broker keeps the other sites' tasks from learner-1's user: it may not read them.
            other = f"amqp://{second}:site-pass-2@{deployed.where}/{deployed.vhost}"
            for operation in (lambda ch: ch.basic_get(topology.site_queue("hospital-a")),
                              lambda ch: ch.queue_delete(topology.site_queue("hospital-b"))):
                conn = pika.BlockingConnection(pika.URLParameters(other))
                with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
                    operation(conn.channel())
                assert refused.value.reply_code == 403
                conn.close()

            # Job 1, every site served: learner-0's valid credentials, speaking for hospital-c
            # (learner-1's site), are refused, and the job ends as the undisturbed run does.
            first = c.fedmq("submit", str(spec)).stdout.strip()
            assert c.wait_for(lambda: c.job_round(first) >= 1, timeout=120), c.log("scheduler")[-3000:]
            forged = ClientUpdate(job_id=first, task_id=f"{first}:1:2", round=c.job_round(first),
                                  client=SITES.index("hospital-c"), base_digest="0" * 64, num_examples=10,
                                  learner="forger", weights={})
            conn = pika.BlockingConnection(pika.URLParameters(deployed.url("learner")))
            conn.channel().basic_publish(
                topology.exchange_for(topology.AGGREGATOR), topology.AGGREGATOR, to_wire(forged),
                pika.BasicProperties(delivery_mode=2, user_id=deployed.names["learner"]),
            )
            conn.close()
            assert c.wait_for(lambda: '"site_sender"' in c.log("aggregator"), timeout=60)
            watched = c.fedmq("watch", first, "--json", timeout=240)
            assert watched.returncode == 0, watched.stdout + c.log("scheduler")[-3000:]
            served = json.loads(watched.stdout)

            # Job 2, learner-1 gone: hospital-c and hospital-d drop out of every round by min_fit.
            c.stop("learner-1")
            assert c.wait_for(lambda: len([r for r in c.learner_rows() if r["alive"]]) == 1, timeout=60)
            second_job = c.fedmq("submit", str(spec)).stdout.strip()
            watched = c.fedmq("watch", second_job, "--json", timeout=240)
            assert watched.returncode == 0, watched.stdout + c.log("scheduler")[-3000:]
            dropped = json.loads(watched.stdout)
            history = json.loads(c.fedmq("status", second_job, "--json").stdout)
        finally:
            c.close()
            for proc in c.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
    for name, sites in HOSTS.items():  # routing, not refusal: no learner ever saw another's site
        trained = _trained_sites(c.log(name))
        assert trained and set(trained) <= set(sites), (name, trained)
    assert served["status"] == dropped["status"] == "completed"
    undisturbed = _embedded(spec, tmp_path / "all-data", tmp_path / "embedded")
    assert_bit_identical(load_state(served["model_path"])[0], load_state(undisturbed["model_path"])[0])
    without = _embedded(spec, tmp_path / "all-data", tmp_path / "embedded-2", sites=SITES[:2])
    assert_bit_identical(load_state(dropped["model_path"])[0], load_state(without["model_path"])[0])
    assert '"unserved_sites"' in json.dumps(history), history  # `fedmq status` names the dropped sites
    print(f"\nsites: job 2's status: {json.dumps(history)[:600]}")
