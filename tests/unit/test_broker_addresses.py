"""FEDMQ_BROKER_URL names one broker or a cluster's nodes; every address stays password-free in messages."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fedmq.common.bus.connection import BrokerConnection, connection_parameters
from fedmq.common.errors import BrokerUnavailable
from fedmq.common.settings import Settings

NODES = "amqp://u:s3cret@rabbit-1:5672/fedmq, amqp://u:s3cret@rabbit-2:5672/fedmq,amqps://u:s3cret@rabbit-3/fedmq"


def settings(broker_url: str) -> Settings:
    return Settings(_env_file=None, broker_url=broker_url)


def test_one_url_is_still_one_broker() -> None:
    s = settings("amqp://guest:guest@127.0.0.1:5672/%2F")
    assert s.broker_urls == ("amqp://guest:guest@127.0.0.1:5672/%2F",)
    assert s.safe_broker_url == "amqp://guest:***@127.0.0.1:5672/%2F"


def test_a_comma_separated_list_names_each_node_in_order() -> None:
    s = settings(NODES)
    assert s.broker_urls == (
        "amqp://u:s3cret@rabbit-1:5672/fedmq", "amqp://u:s3cret@rabbit-2:5672/fedmq", "amqps://u:s3cret@rabbit-3/fedmq",
    )
    assert s.safe_broker_url == (
        "amqp://u:***@rabbit-1:5672/fedmq, amqp://u:***@rabbit-2:5672/fedmq, amqps://u:***@rabbit-3/fedmq"
    )
    assert [p.host for p in connection_parameters(s, "test")] == ["rabbit-1", "rabbit-2", "rabbit-3"]


def test_a_comma_inside_one_url_does_not_split_it() -> None:
    s = settings("amqp://u:pa,ss@rabbit-1/fedmq,amqp://u:pa,ss@rabbit-2/fedmq")
    assert s.broker_urls == ("amqp://u:pa,ss@rabbit-1/fedmq", "amqp://u:pa,ss@rabbit-2/fedmq")


@pytest.mark.parametrize("bad", ["", " , ", "amqp://u:s3cret@rabbit-1/, http://u:s3cret@rabbit-2/"])
def test_a_list_without_a_broker_or_with_a_foreign_scheme_is_refused_without_passwords(bad: str) -> None:
    with pytest.raises(ValidationError) as caught:
        settings(bad)
    messages = " ".join(e["msg"] for e in caught.value.errors())  # what the CLI prints
    assert "amqp://" in messages and "s3cret" not in messages


def test_no_node_answering_is_one_error_naming_every_address() -> None:
    s = settings("amqp://u:s3cret@127.0.0.1:1/fedmq,amqp://u:s3cret@127.0.0.1:2/fedmq")
    link = BrokerConnection(s, "test", on_open=lambda: None, on_lost=lambda: None)
    with pytest.raises(BrokerUnavailable) as caught:
        link.connect()
    message = str(caught.value)
    assert "any of 2 RabbitMQ nodes" in message
    assert "amqp://u:***@127.0.0.1:1/fedmq" in message and "amqp://u:***@127.0.0.1:2/fedmq" in message
    assert "s3cret" not in message
