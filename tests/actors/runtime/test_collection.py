"""The cycle collector's schedule (``runtime/collection.py``): full collections only outside checkpoints.

The schedule is driven by hand (``collect_if_due``, a past ``last``), never slept into: whether a
collection ran is read from the process's totals and from ``gc.get_count``/``gc.get_stats``.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from parkway.actors.runtime import collection
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.metrics import ActorMetrics
from parkway.actors.runtime.participant import ParkReport, Participant
from parkway.actors.runtime.settings import SettingsError
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Abort, Prepare

from tests.support.signed import SECRET


@pytest.fixture(autouse=True)
def own_schedule(monkeypatch: pytest.MonkeyPatch):
    """Each test starts with no schedule of this process (one an earlier test's actor left attached is
    set aside) and ends with the collector as it found it."""
    monkeypatch.setattr(collection, "_collector", None)
    before = gc.get_threshold()
    yield
    assert collection._collector is None
    assert gc.get_threshold() == before


def full_collections() -> int:
    return gc.get_stats()[2]["collections"]


def test_the_settings_are_read_and_bad_ones_refused() -> None:
    assert collection.Schedule.from_env({}) == collection.Schedule("scheduled", 10.0)
    assert collection.Schedule.from_env({"PARKWAY_GC": "Python"}).mode == "python"
    assert collection.Schedule.from_env({"PARKWAY_GC_EVERY_S": "2.5"}).every_s == 2.5
    for bad in ({"PARKWAY_GC": "off"}, {"PARKWAY_GC_EVERY_S": "0"}, {"PARKWAY_GC_EVERY_S": "soon"}):
        with pytest.raises(SettingsError):
            collection.Schedule.from_env(bad)


class Plain:
    """An actor as the schedule sees it: metrics, and maybe ``in_window``."""

    def __init__(self, inside: Callable[[], bool] | None = None) -> None:
        self.metrics = ActorMetrics("plain", 0)
        if inside is not None:
            self.in_window = inside


async def test_attached_only_the_youngest_generation_is_automatic_and_detached_all_is_as_before() -> None:
    python_thresholds = gc.get_threshold()
    first, second = Plain(), Plain()
    assert collection.attach(first, collection.Schedule(every_s=60))
    assert collection.attach(second)  # a second actor of the process joins the same schedule
    assert gc.get_threshold() == (python_thresholds[0], collection.NEVER, collection.NEVER)
    assert gc.get_freeze_count() > 0  # what start-up left alive is not walked again
    fulls = full_collections()
    junk = [[] for _ in range(50 * python_thresholds[0])]  # far past what would start older collections
    del junk
    assert full_collections() == fulls
    collection.detach(first)
    assert collection._collector is not None  # the second still runs
    collection.detach(second)
    assert gc.get_freeze_count() == 0  # (and the fixture checks the thresholds are Python's again)


async def test_python_mode_leaves_the_collector_alone() -> None:
    actor = Plain()
    assert not collection.attach(actor, collection.Schedule(mode="python"))
    assert collection._collector is None and gc.get_freeze_count() == 0
    collection.detach(actor)


async def test_a_due_collection_waits_while_any_actor_is_inside_a_checkpoint() -> None:
    inside = {"agent": True, "tq": False}
    agent, tq = Plain(lambda: inside["agent"]), Plain(lambda: inside["tq"])
    collection.attach(agent, collection.Schedule(every_s=60))
    collection.attach(tq)
    try:
        collector = collection._collector
        assert collector is not None
        done, deferred = collection.totals.collections, collection.totals.deferred
        collector.collect_if_due()
        assert collection.totals.collections == done  # not due yet
        collector.last = time.monotonic() - 61
        collector.collect_if_due()
        assert collection.totals.collections == done and collection.totals.deferred == deferred + 1
        inside["agent"] = False
        fulls = full_collections()
        collector.collect_if_due()
        assert collection.totals.collections == done + 1 and full_collections() == fulls + 1
        assert not collector.due()  # the clock starts again
        inside["agent"] = True
        collector.last = time.monotonic() - 6 * 60  # held open six intervals: no longer deferred
        collector.collect_if_due()
        assert collection.totals.collections == done + 2
    finally:
        collection.detach(agent)
        collection.detach(tq)


class Parking(Participant):
    role = "parking"

    async def wait_until_parked(self, command: Prepare) -> ParkReport:
        return ParkReport(parked=1)


async def test_a_participant_is_inside_from_its_prepare_and_collects_when_the_checkpoint_ends(
    tmp_path: Path,
) -> None:
    async with MemoryBroker(MemoryHub(), "unit") as broker:
        actor = Parking(broker, secret=SECRET, snapshot_root=tmp_path)
        await actor.start()
        try:
            collector = collection._collector
            assert collector is not None and not actor.in_window()
            client = Client(broker, secret=SECRET, sender="controller/0")
            deadline = time.time() + 10
            await client.request("parking/0", Prepare(checkpoint_id="ck-1", deadline=deadline))
            assert actor.in_window()
            collector.last = time.monotonic() - 11  # a collection is due, and deferred meanwhile
            done, deferred = collection.totals.collections, collection.totals.deferred
            collector.collect_if_due()
            assert (collection.totals.collections, collection.totals.deferred) == (done, deferred + 1)
            await client.request("parking/0", Abort(checkpoint_id="ck-1", deadline=deadline))
            assert not actor.in_window()
            for _ in range(3):  # the end schedules it for the loop's next step
                await asyncio.sleep(0)
            assert collection.totals.collections == done + 1
        finally:
            await actor.stop()
