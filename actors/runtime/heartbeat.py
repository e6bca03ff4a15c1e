"""Heartbeats: every actor writes a line about itself to the run's log stream every few seconds.

``parkway status`` reads the last minute of them, so it lists every actor of a run (not only the ones it
knows to ask) and says when each was last heard from, even one that no longer answers. The lines go
straight to the broker, not through the logger: they are for tools, not for the terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from typing import Any, Protocol

import msgspec
from parkway.brokers.base import Broker

HEARTBEAT_EVENT = "heartbeat"
EVERY_S = 5.0

_encode = msgspec.json.Encoder().encode


class Beating(Protocol):
    """What a heartbeat reads of its actor (``runtime.actor.Actor`` is one)."""

    address: str
    broker: Broker

    def status_fields(self, *, asking: int = 0) -> dict[str, Any]: ...


def heartbeat_record(actor: Beating) -> dict[str, Any]:
    fields = actor.status_fields()
    return {
        "ts": datetime.datetime.now(datetime.UTC).isoformat(),
        "event": HEARTBEAT_EVENT,
        "actor": actor.address,
        "run": fields.pop("run"),
        # Not "checkpoint_id": `parkway logs --checkpoint-id` selects on that key, and a heartbeat is
        # no event of the checkpoint.
        "active_checkpoint_id": fields.pop("checkpoint_id", None),
        **{k: v for k, v in fields.items() if k != "counts"},
    }


async def beat(actor: Beating, every_s: float = EVERY_S) -> None:
    """Publish a heartbeat now and then every ``every_s`` until cancelled; a broker hiccup skips one."""
    while True:
        with contextlib.suppress(Exception):
            await actor.broker.publish_log(_encode(heartbeat_record(actor)), checkpoint_id=None)
        await asyncio.sleep(every_s)


def parse_ts(text: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return None
