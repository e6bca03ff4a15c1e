"""The RabbitMQ transport's settings read from the environment and URLs, without a broker: queue
kinds and their arguments, node lists, and the typed errors bad values get."""

from __future__ import annotations

import pytest
from parkway.actors.tools.commands.options import broker_url_problem
from parkway.brokers.base import BrokerError
from parkway.brokers.rabbitmq_layout import QueueKind, split_urls
from parkway.brokers.urls import redact_url


def test_classic_is_the_default_and_quorum_adds_its_arguments() -> None:
    assert QueueKind.from_env({}) == QueueKind("classic", 20)
    assert QueueKind.from_env({}).command_queue_arguments("dlx") == {"x-dead-letter-exchange": "dlx"}
    quorum = QueueKind.from_env({"PARKWAY_QUEUE_TYPE": "quorum", "PARKWAY_DELIVERY_LIMIT": "3"})
    assert quorum.command_queue_arguments("dlx") == {
        "x-dead-letter-exchange": "dlx",
        "x-queue-type": "quorum",
        "x-delivery-limit": 3,
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PARKWAY_QUEUE_TYPE": "stream"}, "want one of classic, quorum"),
        ({"PARKWAY_DELIVERY_LIMIT": "many"}, "want a whole number"),
        ({"PARKWAY_DELIVERY_LIMIT": "0"}, "want 1 or more"),
    ],
)
def test_bad_settings_are_typed_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(BrokerError, match=message):
        QueueKind.from_env(env)


def test_a_node_list_is_split_checked_and_redacted() -> None:
    urls = "amqp://u:secret@a:5672/, amqp://u:secret@b:5672/,"
    assert split_urls(urls) == ["amqp://u:secret@a:5672/", "amqp://u:secret@b:5672/"]
    with pytest.raises(BrokerError):
        split_urls(" , ")
    assert "secret" not in redact_url(urls) and redact_url(urls).count("u:***@") == 2
    assert broker_url_problem(urls) is None
    problem = broker_url_problem("amqp://u:secret@a:5672/,memory://")
    assert problem is not None and "comma-separated" in problem and "secret" not in problem
    problem = broker_url_problem("http://u:secret@a/")
    assert problem is not None and "secret" not in problem
