"""Fixtures of the whole-system tests: actor processes of this test's run on the real RabbitMQ, and a
client to talk to them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from parkway.actors.runtime.client import Client
from parkway.brokers.rabbitmq import RabbitBroker

from tests.support.processes import SECRET, Process, start_actor_process


@pytest.fixture
async def spawn(
    amqp_url: str, run_name: str, tmp_path: Path, rabbit_cleanup: Callable[[str, list[str]], None]
) -> AsyncIterator[Callable[..., Process]]:
    """Start actor processes for this test's run; every one is stopped and the run deleted afterwards."""
    started: list[Process] = []

    def start(role: str, replica: int = 0, args: tuple[str, ...] = (), **env: str) -> Process:
        actor = start_actor_process(role, replica, amqp_url, run_name, tmp_path / "state", args=args, **env)
        started.append(actor)
        # The driver's process declares the controller's queues, and the trainer's when it hosts it inline.
        rabbit_cleanup(run_name, sorted({a.address for a in started} | {"controller/0", "trainer/0"}))
        return actor

    yield start
    for actor in started:
        actor.stop()


@pytest.fixture
async def client(amqp_url: str, run_name: str) -> AsyncIterator[Client]:
    async with RabbitBroker(amqp_url, run_name) as broker:
        yield Client(broker, secret=SECRET.encode(), sender="controller/0")
