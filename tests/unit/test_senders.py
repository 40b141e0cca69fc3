"""The sender table: each message type from the users of its role only, on both buses."""

from __future__ import annotations

import pytest

from fedmq.common import messages
from fedmq.common.bus.base import Delivery
from fedmq.common.bus.factory import user_of
from fedmq.common.bus.memory import MemoryBroker
from fedmq.common.errors import ValidationError
from fedmq.common.senders import SENDERS, check_sender, may_send
from fedmq.common.settings import Settings

ROLES = Settings(_env_file=None).role_users  # the defaults: each role's own user, and guest
# Answers and events go to queues only their askers and watchers read: not in the table.
UNCHECKED = {"model_reply", "client_state_reply", "status_reply", "job_event"}


def message_types() -> set[str]:
    return {
        cls.model_fields["type"].default for cls in vars(messages).values()
        if isinstance(cls, type) and issubclass(cls, messages.Message) and "type" in cls.model_fields
    }


def test_every_message_type_sent_to_a_work_queue_has_its_senders() -> None:
    assert set(SENDERS) == message_types() - UNCHECKED


@pytest.mark.parametrize(("message_type", "user", "allowed"), [
    ("client_update", "learner", True),
    ("client_update", "cli", False),
    ("client_update", "scheduler", False),  # the scheduler sends round control, not updates
    ("round_close", "scheduler", True),
    ("round_close", "learner", False),
    ("train_task", "aggregator", False),
    ("update_accepted", "aggregator", True),
    ("update_accepted", "cli", False),
    ("client_failure", "cli", False),
    ("job_submit", "cli", True),
    ("job_submit", "learner", False),
    ("model_get", "cli", True),
    ("client_state_get", "cli", True),  # Result.client_state over a broker
    ("client_state_get", "scheduler", False),
    ("model_get", "learner", True),
    ("client_update", "guest", True),  # a broker without definitions: guest can do anything there
    ("client_update", "mallory", False),
    ("client_update", None, False),  # RabbitMQ checks user_id only when a publisher sets it
    ("client_update", "", False),
    ("model_reply", "aggregator", False),  # not a message anyone sends to a work queue
])
def test_a_message_is_taken_only_from_a_user_of_its_role(
    message_type: str, user: str | None, allowed: bool
) -> None:
    assert may_send(message_type, user, ROLES) is allowed


def test_a_refusal_names_the_setting_that_would_allow_the_sender() -> None:
    with pytest.raises(ValidationError) as info:
        check_sender("client_update", "cli", ROLES)
    assert info.value.reason == "sender"
    assert "'cli'" in info.value.detail and "FEDMQ_LEARNER_USERS" in info.value.detail
    with pytest.raises(ValidationError, match="no user_id"):
        check_sender("round_close", None, ROLES)


def test_role_users_are_read_from_comma_separated_settings() -> None:
    settings = Settings(_env_file=None, learner_users=" learner-a, learner-b ,", cli_users="")
    assert settings.role_users["learner"] == {"learner-a", "learner-b"}
    assert settings.role_users["cli"] == frozenset()
    assert not may_send("job_submit", "cli", settings.role_users)


def test_the_memory_bus_stamps_each_message_with_its_buss_user() -> None:
    broker = MemoryBroker()
    got: list[str | None] = []

    def handle(delivery: Delivery) -> None:
        got.append(delivery.user_id)
        delivery.ack()

    consumer = broker.connect("aggregator")
    consumer.consume("q", handle, prefetch=2)  # both handed over before the stop queued behind them
    broker.connect("learner").publish("q", b"1")
    broker.connect().publish("q", b"2")
    consumer.stop()
    consumer.run()  # handles what was delivered, then returns
    assert got == ["learner", "guest"]


@pytest.mark.parametrize(("bus", "user"), [
    ("scheduler", "scheduler"), ("aggregator", "aggregator"), ("learner-0", "learner"),
    ("learner-12", "learner"), ("client", "cli"),
])
def test_the_embedded_services_publish_as_their_deployed_users(bus: str, user: str) -> None:
    assert user_of(bus) == user
