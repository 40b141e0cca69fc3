"""Sites: names, specs, settings, the registry's hosted sites and who may speak for a site."""

from __future__ import annotations

import pytest
from pydantic import ValidationError as PydanticError

from fedmq.common.bus import topology
from fedmq.common.errors import ValidationError
from fedmq.common.jobspec import ClientsSpec
from fedmq.common.messages import Heartbeat
from fedmq.common.senders import check_site_sender
from fedmq.common.settings import Settings
from fedmq.services.scheduler.registry import Registry


def test_a_site_has_its_own_queue_behind_the_site_exchange() -> None:
    queue = topology.site_queue("hospital-a")
    assert queue == "fedmq.site.hospital-a" and topology.is_site_queue(queue)
    assert topology.exchange_for(queue) == topology.SITES
    assert not topology.is_site_queue(topology.TASKS)
    for bad in ("", "a.b", "a/b", "-a", "x" * 65, "a b"):
        with pytest.raises(ValueError, match="not a site name"):
            topology.site_queue(bad)


def test_a_spec_names_sites_as_its_clients() -> None:
    clients = ClientsSpec.model_validate({"sites": ["a", "b", "c"], "min_fit": 2})
    assert clients.total == 3 and clients.site(1) == "b" and clients.quorum == 2
    assert ClientsSpec(total=3).site(1) is None
    with pytest.raises(PydanticError, match="named once"):
        ClientsSpec.model_validate({"sites": ["a", "a"]})
    with pytest.raises(PydanticError, match="must equal the number of sites"):
        ClientsSpec.model_validate({"sites": ["a"], "total": 2})
    with pytest.raises(PydanticError, match="letters, digits"):
        ClientsSpec.model_validate({"sites": ["a.b"]})


def test_settings_read_sites_and_their_users() -> None:
    settings = Settings(sites=" a, b,a", site_users="a:u1, a:u2,b:u3")
    assert settings.site_names == ("a", "b")
    assert settings.users_of_sites == {"a": frozenset({"u1", "u2"}), "b": frozenset({"u3"})}
    with pytest.raises(PydanticError, match="site:user"):
        Settings(site_users="a")
    with pytest.raises(PydanticError, match="not a site name"):
        Settings(sites="a.b")


def test_only_a_sites_users_speak_for_it() -> None:
    users = Settings(site_users="a:u1").users_of_sites
    check_site_sender("a", "u1", users)
    check_site_sender("b", "anyone", users)  # a site not bound to users: any learner's (role checked)
    check_site_sender(None, "anyone", users)  # a logical client
    for forger in ("u2", None):
        with pytest.raises(ValidationError, match="FEDMQ_SITE_USERS") as refused:
            check_site_sender("a", forger, users)
        assert refused.value.reason == "site_sender"


def test_the_registry_knows_which_sites_live_learners_host() -> None:
    registry = Registry()
    beat = {"node": "n", "device": "cpu", "interval_s": 1.0}
    registry.heartbeat(Heartbeat(learner="l0", replica=0, sites=["a", "b"], **beat), now=0.0)
    registry.heartbeat(Heartbeat(learner="l1", replica=1, sites=["c"], **beat), now=0.0)
    assert registry.hosted_sites() == {"a", "b", "c"}
    registry.heartbeat(Heartbeat(learner="l0", replica=0, sites=["a", "b"], **beat), now=5.0)
    assert registry.sweep(now=5.0) == ["l1"]
    assert registry.hosted_sites() == {"a", "b"}
    assert [row.sites for row in registry.alive()] == [("a", "b")]


def test_a_sites_stored_state_goes_to_its_own_users_only() -> None:
    """SCAFFOLD's control variates and compression's residual are derived from a site's data."""
    from types import SimpleNamespace

    import torch

    from fedmq.common.jobspec import parse_job
    from fedmq.common.messages import ClientStateGet, ClientStateReply, expect, from_wire
    from fedmq.services.aggregator.serving import ModelServer

    stored = SimpleNamespace(read=lambda client, before: {"c": torch.ones(2)})
    spec = parse_job({"name": "s", "task": "digits", "clients": {"sites": ["a", "b"]}, "rounds": 2})
    nothing = SimpleNamespace(read=lambda client, before: {})
    job = SimpleNamespace(spec=spec, round=1, clients=stored, residuals=nothing)
    learners = frozenset({"u1", "u2"})
    server = ModelServer(bus=None, jobs={"j": job}, senders={"learner": learners, "cli": frozenset({"me"})},  # type: ignore[arg-type,dict-item]
                         users_of_sites=Settings(site_users="a:u1").users_of_sites)

    def ask(client: int, user: str) -> ClientStateReply:
        body = server.client_state(ClientStateGet(job_id="j", round=2, client=client), user)
        return expect(from_wire(body), ClientStateReply)

    assert ask(0, "u1").state is not None and ask(0, "u1").error is None
    refused = ask(0, "u2")
    assert refused.state is None and refused.error is not None and refused.error.startswith("site_sender")
    assert ask(1, "u2").error is None  # site b is bound to no user: any learner's
    for client in (0, 1):  # a CLI user reads logical clients' state, never a site's
        assert ask(client, "me").state is None and "goes to its learners only" in str(ask(client, "me").error)


def test_a_heartbeat_claims_only_the_sites_its_user_may_serve() -> None:
    import threading
    import time
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from fedmq.common.bus.memory import MemoryBroker
    from fedmq.common.messages import to_wire
    from fedmq.services.scheduler.service import SchedulerService

    broker = MemoryBroker()
    with TemporaryDirectory() as state:
        settings = Settings(state_dir=Path(state), site_users="a:u1", learner_users="u1,u2")
        scheduler = SchedulerService(settings, broker.connect("scheduler"))
        scheduler.start()
        thread = threading.Thread(target=scheduler.bus.run, daemon=True)
        thread.start()
        try:
            beat = Heartbeat(learner="l2", node="n", replica=0, device="cpu", sites=["a", "b"])
            broker.connect("u2").publish(topology.SCHEDULER, to_wire(beat))
            deadline = time.monotonic() + 10
            while scheduler.registry.alive_count == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert scheduler.registry.hosted_sites() == {"b"}  # u2 may not serve site a
        finally:
            scheduler.bus.stop()
            thread.join(10)
