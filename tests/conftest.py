"""Fixtures every test package uses: broker URLs, per-test run names, brokers of both kinds and clean-up
of what a test declared on RabbitMQ. The marker check (``tests/support/markers.py``) is loaded here."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from parkway.brokers.base import Broker, DeadLetterBounds
from parkway.brokers.memory import MemoryBroker, MemoryHub

from tests.support.rabbit import AMQP_URL, delete_run, rabbitmq_reachable

pytest_plugins = ["tests.support.markers"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """matplotlib builds its font cache on first use by running ``fc-list``: here, once, before any
    test, not inside whichever test first draws (which the marker check would see start a process)."""
    with contextlib.suppress(ImportError):  # without the report extra nothing draws
        import matplotlib.font_manager  # noqa: F401


def pytest_collection_finish(session: pytest.Session) -> None:
    """Nothing imported while collecting may configure logging: every test after it would log through
    that configuration (a level filter hides events from ``capture_logs``), in an order-dependent way.
    Configure it in a function, when it is needed."""
    import structlog

    if structlog.is_configured():
        raise pytest.UsageError(
            "structlog was configured while the tests were collected (a module configures logging on "
            "import): " + repr(structlog.get_config()["wrapper_class"])
        )


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


@pytest.fixture
async def rabbit_cleanup(amqp_url: str) -> AsyncIterator[Callable[[str, list[str]], None]]:
    """Register (run, addresses) to delete after the test."""
    registered: list[tuple[str, list[str]]] = []
    yield lambda run, addresses: registered.append((run, addresses))
    for run, addresses in registered:
        await delete_run(amqp_url, run, addresses)


# The RabbitMQ case carries its marker: ``-m "not rabbitmq"`` keeps the in-memory case of each test.
@pytest.fixture(params=["memory", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
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

    def factory(run: str | None = None, *, dead_letter_bounds: DeadLetterBounds | None = None) -> Broker:
        if broker_kind == "memory":
            broker: Broker = MemoryBroker(hub, run or run_name, dead_letter_bounds=dead_letter_bounds)
        else:
            url = request.getfixturevalue("amqp_url")
            from parkway.brokers.rabbitmq import RabbitBroker

            broker = RabbitBroker(url, run or run_name, dead_letter_bounds=dead_letter_bounds)
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
