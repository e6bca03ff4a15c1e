"""The cycle collector's schedule (``runtime/collection.py``): full collections only outside checkpoints.

The schedule is driven by hand (``collect_if_due``, a past ``last``), never slept into: whether a
collection ran is read from the process's totals and from ``gc.get_count``/``gc.get_stats``.
"""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import pytest
from parkway.actors.runtime import collection
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.participant import ParkReport, Participant
from parkway.actors.runtime.settings import SettingsError
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Abort, Prepare

from tests.support.signed import SECRET


@pytest.fixture(autouse=True)
def no_schedule_left_over():
    """Each test starts and ends with Python's own collector (no actor of another test attached)."""
    assert collection._collector is None
    before = gc.get_threshold()
    yield
    assert collection._collector is None
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def full_collections() -> int:
    return gc.get_stats()[2]["collections"]


def test_the_settings_are_read_and_bad_ones_refused() -> None:
    assert collection.Schedule.from_env({}) == collection.Schedule("scheduled", 10.0)
    assert collection.Schedule.from_env({"PARKWAY_GC": "Python"}).mode == "python"
    assert collection.Schedule.from_env({"PARKWAY_GC_EVERY_S": "2.5"}).every_s == 2.5
    for bad in ({"PARKWAY_GC": "off"}, {"PARKWAY_GC_EVERY_S": "0"}, {"PARKWAY_GC_EVERY_S": "soon"}):
        with pytest.raises(SettingsError):
            collection.Schedule.from_env(bad)


async def test_attached_only_the_youngest_generation_is_automatic_and_detached_all_is_as_before() -> None:
    python_thresholds = gc.get_threshold()
    assert collection.attach(1, lambda: False, collection.Schedule(every_s=60))
    assert collection.attach(2, lambda: False)  # a second actor of the process joins the same schedule
    assert gc.get_threshold() == (python_thresholds[0], collection.NEVER, collection.NEVER)
    assert gc.get_freeze_count() > 0  # what start-up left alive is not walked again
    fulls = full_collections()
    junk = [[] for _ in range(50 * python_thresholds[0])]  # far past what would start older collections
    del junk
    assert full_collections() == fulls
    await collection.detach(1)
    assert collection._collector is not None  # actor 2 still runs
    await collection.detach(2)
    # (the fixture checks the thresholds and the frozen objects are Python's again)


async def test_python_mode_leaves_the_collector_alone() -> None:
    assert not collection.attach(1, lambda: False, collection.Schedule(mode="python"))
    assert collection._collector is None and gc.get_freeze_count() == 0
    await collection.detach(1)


async def test_a_due_collection_waits_while_any_actor_is_inside_a_checkpoint() -> None:
    inside = {"agent": True, "tq": False}
    collection.attach(1, lambda: inside["agent"], collection.Schedule(every_s=60))
    collection.attach(2, lambda: inside["tq"])
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
    finally:
        await collection.detach(1)
        await collection.detach(2)


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
            collector.last = time.monotonic() - 3600  # a collection is due, and deferred meanwhile
            collector.collect_if_due()
            done = collection.totals.collections
            await client.request("parking/0", Abort(checkpoint_id="ck-1", deadline=deadline))
            assert not actor.in_window()
            for _ in range(3):  # the end schedules it for the loop's next step
                await asyncio.sleep(0)
            assert collection.totals.collections == done + 1
        finally:
            await actor.stop()
