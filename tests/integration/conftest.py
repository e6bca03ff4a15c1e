from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from parkway.actors.runtime.client import Client
from parkway.brokers.rabbitmq import RabbitBroker

from tests.integration.processes import SECRET, ActorProcess

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
async def spawn(
    amqp_url: str, run_name: str, tmp_path: Path, rabbit_cleanup
) -> AsyncIterator[Callable[..., ActorProcess]]:
    """Start actor processes for this test's run; every one is killed and the run deleted afterwards."""
    started: list[ActorProcess] = []

    def start(role: str, replica: int = 0, args: tuple[str, ...] = (), **env: str) -> ActorProcess:
        actor = ActorProcess(
            role, replica, amqp_url, run_name, tmp_path / "state", extra_env=env, extra_args=args
        ).start()
        started.append(actor)
        rabbit_cleanup(run_name, sorted({a.address for a in started} | {"controller/0"}))
        return actor

    yield start
    for actor in started:
        actor.stop()


@pytest.fixture
async def client(amqp_url: str, run_name: str) -> AsyncIterator[Client]:
    async with RabbitBroker(amqp_url, run_name) as broker:
        yield Client(broker, secret=SECRET.encode(), sender="controller/0")
