"""Structure sizes (``Actor.structure_sizes``): in ``Status``, in the gauge read at scrape time, in the
``parkway status`` table; a role's own structures join the runtime's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.runtime.actor import Actor
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.metrics import process_registry
from parkway.actors.runtime.structures import GAUGE, StructureCollector, read_sizes
from parkway.actors.tools.status import structures_note, table
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Probe, ProbeResult, Status, StatusReport

from tests.support.signed import SECRET

RUN = "unit"


class Keeper(Actor):
    """A role with a structure of its own, as roles override the hook."""

    role = "tq"

    def __init__(self, broker: MemoryBroker, **kwargs: Any) -> None:
        super().__init__(broker, **kwargs)
        self.sessions: dict[str, int] = {}

    def structure_sizes(self) -> dict[str, int]:
        return {**super().structure_sizes(), "sessions": len(self.sessions)}


@pytest.fixture
async def broker():
    async with MemoryBroker(MemoryHub(), RUN) as b:
        yield b


@pytest.fixture
async def keeper(broker: MemoryBroker, tmp_path: Path):
    actor = Keeper(broker, secret=SECRET, state_dir=tmp_path / "state")
    await actor.start()
    yield actor
    await actor.stop()


def soon() -> float:
    return time.time() + 10


def gauge(actor: Actor, structure: str) -> float | None:
    labels = {"role": actor.role, "replica": str(actor.replica), "structure": structure}
    return actor.metrics.registry.get_sample_value(GAUGE, labels)


async def test_status_reports_the_runtime_structures_and_the_roles_own(
    keeper: Keeper, broker: MemoryBroker
) -> None:
    client = Client(broker, secret=SECRET, sender="controller/0")
    for n in range(3):  # three control commands answered: three cached, journalled replies
        assert isinstance(
            await client.request("tq/0", Probe(checkpoint_id=f"p-{n}", deadline=soon())), ProbeResult
        )
    keeper.sessions.update(a=1, b=2)
    report = await client.request("tq/0", Status(checkpoint_id="s-1", deadline=soon()))
    assert isinstance(report, StatusReport)
    assert report.structures["reply_cache"] == 3
    assert report.structures["reply_journal_records"] == 3
    assert report.structures["reply_journal_bytes"] == (keeper.state_dir / "replies.journal").stat().st_size
    assert report.structures["sessions"] == 2
    assert report.structures["reply_cache_running"] == 0  # none still being handled
    assert report.structures["requests_in_hand"] == 1  # the Status itself
    assert report.structures["answered_requests"] == 3


async def test_the_gauge_is_read_when_scraped(keeper: Keeper, broker: MemoryBroker) -> None:
    assert gauge(keeper, "sessions") == 0
    keeper.sessions["x"] = 1
    assert gauge(keeper, "sessions") == 1  # no update call: the value is read at scrape time
    client = Client(broker, secret=SECRET, sender="controller/0")
    await client.request("tq/0", Probe(checkpoint_id="p-1", deadline=soon()))
    assert gauge(keeper, "reply_cache") == 1
    # and in the process's merged registry, next to the other actors' metrics
    merged = process_registry([keeper])
    labels = {"role": "tq", "replica": "0", "structure": "reply_cache"}
    assert merged.get_sample_value(GAUGE, labels) == 1


class Broken(Keeper):
    def __init__(self, broker: MemoryBroker, **kwargs: Any) -> None:
        super().__init__(broker, **kwargs)
        self.resizing = 0

    def structure_sizes(self) -> dict[str, int]:
        self.resizing += 1
        if self.resizing == 1:  # as a dict resized under an iteration in another thread reads
            raise RuntimeError("dictionary changed size during iteration")
        if self.resizing == 2:
            return super().structure_sizes()
        raise ValueError("a role's bug")


async def test_a_failing_override_costs_the_reading_not_the_scrape(broker: MemoryBroker) -> None:
    actor = Broken(broker, secret=SECRET)
    assert "sessions" in read_sizes(actor)  # the RuntimeError was read again
    assert read_sizes(actor) == {}  # the bug: nothing, and no exception into the scrape or Status
    assert next(iter(StructureCollector(actor).collect())).samples == []


def test_the_status_table_shows_the_largest_structures() -> None:
    structures = {"reply_cache": 12, "sessions": 300, "reply_journal_bytes": 99999, "fences": 0}
    assert structures_note(structures) == "sessions=300 reply_cache=12 fences=0"
    assert structures_note({f"s{n}": n for n in range(8)}, limit=2) == "s7=7 s6=6 (+6)"
    row = {"address": "tq/0", "role": "tq", "replica": 0, "reachable": True, "structures": structures}
    assert table([row], now=0.0).splitlines()[1].endswith("sessions=300 reply_cache=12 fences=0")
