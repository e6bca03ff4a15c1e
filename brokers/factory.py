"""Pick a transport from a URL: ``memory://`` (in-process) or ``amqp://`` / ``amqps://`` (RabbitMQ)."""

from __future__ import annotations

from parkway.brokers.base import Broker, BrokerError, DeadLetterBounds
from parkway.brokers.memory import MemoryBroker, MemoryHub

# One hub per process: every ``memory://`` connection in a process shares it, like one broker node.
_PROCESS_HUB = MemoryHub()


def connect(url: str, run: str, *, connection_name: str | None = None, wait_s: float = 0.0) -> Broker:
    """A not-yet-started broker connection for ``run`` (use ``async with`` or ``await start()``), its
    dead-letter bounds from ``PARKWAY_DEAD_LETTER_MAX_LENGTH`` / ``PARKWAY_DEAD_LETTER_MAX_AGE_S``.
    ``wait_s``: how long starting it waits for a RabbitMQ that is not up (a long-running process's)."""
    try:
        bounds = DeadLetterBounds.from_env()
    except ValueError as exc:
        raise BrokerError(f"dead-letter bounds: {exc}") from None
    if url.startswith("memory://"):
        return MemoryBroker(_PROCESS_HUB, run, dead_letter_bounds=bounds)
    if url.startswith(("amqp://", "amqps://")):
        from parkway.brokers.rabbitmq import RabbitBroker  # aio-pika loads only when used

        return RabbitBroker(
            url, run, connection_name=connection_name, dead_letter_bounds=bounds, connect_wait_s=wait_s
        )
    raise ValueError(f"unsupported broker URL {url!r}: use memory:// or amqp://user:pass@host:port/")
