"""Which lane the controller's messages take in a whole embedded run with snapshots: every control
command on the control lane, except TQ's capture (its Prepare and Commit), which goes on TQ's data lane
so that it is queued behind the rows already sent to TQ (``SaveSequence.capture``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from parkway.actors.roles.controller.controller import SimulatedCrash
from parkway.brokers.base import Envelope, Lane
from parkway.brokers.memory import MemoryBroker
from parkway.protocol.messages import CONTROL_COMMANDS
from parkway.protocol.signing import TYPE_HEADER

from tests.support.embedded import SNAPSHOT_RUN, embedded_run

COMMANDS = {cls.__name__ for cls in CONTROL_COMMANDS}


async def test_a_snapshots_commands_take_the_control_lane_but_the_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[str, str, Lane]] = []
    real_publish = MemoryBroker.publish

    async def publish(
        self: MemoryBroker, address: str, envelope: Envelope, *, lane: Lane = Lane.DATA
    ) -> None:
        sent.append((address, envelope.headers.get(TYPE_HEADER, ""), lane))
        await real_publish(self, address, envelope, lane=lane)

    monkeypatch.setattr(MemoryBroker, "publish", publish)
    with pytest.raises(SimulatedCrash):  # stopped right after its first published snapshot
        await embedded_run(SNAPSHOT_RUN, tmp_path, stop_after=1)

    in_band = ("Prepare", "Commit")
    captures = [(a, kind, lane) for a, kind, lane in sent if a == "tq/0" and kind in in_band]
    assert {kind for _, kind, _ in captures} == set(in_band)
    assert {lane for _, _, lane in captures} == {Lane.DATA}
    others = {(kind, lane) for a, kind, lane in sent if not (a == "tq/0" and kind in in_band)}
    assert {kind for kind, lane in others if kind in COMMANDS} >= {"Discover", "Prepare", "Commit", "Status"}
    assert {lane for kind, lane in others if kind in COMMANDS} == {Lane.CONTROL}
    assert {lane for kind, lane in others if kind not in COMMANDS} == {Lane.DATA}
    assert {"Run", "Generate", "Rows"} <= {kind for kind, _ in others}
