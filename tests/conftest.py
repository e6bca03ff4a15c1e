"""Shared fixtures: broker URLs, per-test run names, and clean-up of what a test declared on RabbitMQ."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlparse

import pytest
from parkway.brokers.base import Broker
from parkway.brokers.memory import MemoryBroker, MemoryHub

AMQP_URL = os.environ.get("PARKWAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
TEST_SECRET = b"test-secret-0123456789abcdef"


def rabbitmq_reachable() -> bool:
    parsed = urlparse(AMQP_URL)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 5672), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def amqp_url() -> str:
    # A test that needs the real broker fails loudly without it: a skip would hide a missing broker in CI.
    assert rabbitmq_reachable(), (
        f"RabbitMQ is not reachable at {AMQP_URL}; start it (rabbitmq-server -detached)"
    )
    return AMQP_URL


@pytest.fixture
def run_name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


async def delete_run(url: str, run: str, addresses: list[str]) -> None:
    """Remove a test run's queues and exchanges from RabbitMQ."""
    import aio_pika

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        prefix = f"pk.{run}"
        for name in [*(f"{prefix}.q.{a}" for a in addresses), f"{prefix}.dead", f"{prefix}.logs"]:
            await channel.queue_delete(name)
        for name in (prefix, f"{prefix}.dlx", f"{prefix}.logs"):
            await channel.exchange_delete(name)


@pytest.fixture
async def rabbit_cleanup(amqp_url: str) -> AsyncIterator[Callable[[str, list[str]], None]]:
    """Register (run, addresses) to delete after the test."""
    registered: list[tuple[str, list[str]]] = []
    yield lambda run, addresses: registered.append((run, addresses))
    for run, addresses in registered:
        await delete_run(amqp_url, run, addresses)


@pytest.fixture(params=["memory", "rabbitmq"])
def broker_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def make_broker(
    broker_kind: str, run_name: str, request: pytest.FixtureRequest
) -> AsyncIterator[Callable[..., Broker]]:
    """A factory of started-on-use brokers of the parametrised kind, all closed after the test."""
    hub = MemoryHub()
    made: list[Broker] = []
    addresses: set[str] = set()

    def factory(run: str | None = None) -> Broker:
        if broker_kind == "memory":
            broker: Broker = MemoryBroker(hub, run or run_name)
        else:
            url = request.getfixturevalue("amqp_url")
            from parkway.brokers.rabbitmq import RabbitBroker

            broker = RabbitBroker(url, run or run_name)
        made.append(broker)
        original = broker.declare

        async def declare(address: str) -> None:
            addresses.add(address)
            await original(address)

        broker.declare = declare  # type: ignore[method-assign]
        return broker

    yield factory
    for broker in made:
        await broker.close()
    if broker_kind == "rabbitmq":
        for run in {b.run for b in made}:
            await delete_run(AMQP_URL, run, sorted(addresses))
