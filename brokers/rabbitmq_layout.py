"""What a run's exchanges and queues on RabbitMQ are called, and what kind of queue they are.

Names (all durable, per run ``R``): exchanges ``pk.R`` (data) and ``pk.R.control`` route to each
address's queues ``pk.R.q.<address>`` and ``pk.R.c.<address>``; ``pk.R.dlx`` -> ``pk.R.dead`` for dead
letters; ``pk.R.logs``, a stream of every actor's log lines. The kinds (``QueueKind``): ``classic`` on
one node, ``quorum`` on a cluster (``rabbitmq.py`` says what each setting is for).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aio_pika.abc import FieldValue
from parkway.brokers.base import BrokerError, Lane

LOG_STREAM_MAX_BYTES = 256 * 1024 * 1024
QUEUE_TYPE_ENV = "PARKWAY_QUEUE_TYPE"
DELIVERY_LIMIT_ENV = "PARKWAY_DELIVERY_LIMIT"
QUEUE_TYPES = ("classic", "quorum")
DEFAULT_DELIVERY_LIMIT = 20  # redeliveries of one message before a quorum queue dead-letters it

# The part of a queue's name that says its lane: ``pk.R.q.<address>`` (data, the name it always had)
# and ``pk.R.c.<address>`` (control).
LANE_QUEUE_INFIX = {Lane.DATA: "q", Lane.CONTROL: "c"}


def run_prefix(run: str) -> str:
    """What every name of run ``run`` on the broker starts with."""
    return f"pk.{run}"


def queue_name(run: str, address: str, lane: Lane = Lane.DATA) -> str:
    """The queue of ``address``'s ``lane`` in run ``run``."""
    return f"{run_prefix(run)}.{LANE_QUEUE_INFIX[lane]}.{address}"


def exchange_name(run: str, lane: Lane = Lane.DATA) -> str:
    """The direct exchange that routes ``lane``'s messages to their address's queue."""
    return run_prefix(run) if lane is Lane.DATA else f"{run_prefix(run)}.control"


def run_queues(run: str, addresses: Iterable[str]) -> list[str]:
    """Every queue run ``run`` declares for ``addresses``: both lanes of each, the dead letters, the
    log stream. What a clean-up deletes (a queue is durable: it outlives every process)."""
    lanes = [queue_name(run, address, lane) for address in addresses for lane in Lane]
    return [*lanes, f"{run_prefix(run)}.dead", f"{run_prefix(run)}.logs"]


def run_exchanges(run: str) -> list[str]:
    """Every exchange run ``run`` declares: each lane's, the dead letters', the logs'."""
    return [*(exchange_name(run, lane) for lane in Lane), f"{run_prefix(run)}.dlx", f"{run_prefix(run)}.logs"]


def split_urls(url: str) -> list[str]:
    """The nodes' URLs of a (comma-separated) broker URL, in order."""
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise BrokerError("no broker URL given")
    return urls


@dataclass(frozen=True, slots=True)
class QueueKind:
    """What kind of queue an actor's command queues and the dead-letter queue are."""

    type: str = "classic"
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT

    def __post_init__(self) -> None:
        if self.type not in QUEUE_TYPES:
            raise BrokerError(f"{QUEUE_TYPE_ENV}={self.type!r}: want one of {', '.join(QUEUE_TYPES)}")
        if self.delivery_limit < 1:
            raise BrokerError(f"{DELIVERY_LIMIT_ENV}={self.delivery_limit}: want 1 or more")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> QueueKind:
        env = os.environ if environ is None else environ
        kind = env.get(QUEUE_TYPE_ENV, "").strip() or "classic"
        limit = env.get(DELIVERY_LIMIT_ENV, "").strip()
        try:
            delivery_limit = int(limit) if limit else DEFAULT_DELIVERY_LIMIT
        except ValueError:
            raise BrokerError(f"{DELIVERY_LIMIT_ENV}={limit!r}: want a whole number") from None
        return cls(type=kind, delivery_limit=delivery_limit)

    def command_queue_arguments(self, dead_letter_exchange: str) -> dict[str, FieldValue]:
        arguments: dict[str, FieldValue] = {"x-dead-letter-exchange": dead_letter_exchange}
        if self.type == "quorum":
            arguments |= {
                "x-queue-type": "quorum",
                "x-delivery-limit": self.delivery_limit,
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",  # what at-least-once dead-lettering requires
            }
        return arguments
