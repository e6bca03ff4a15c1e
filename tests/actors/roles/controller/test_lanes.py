"""Which lane the controller's messages take in a whole embedded run with snapshots: every control
command on the control lane, except TQ's capture (its Prepare and Commit), which goes on TQ's data lane
so that it is queued behind the rows already sent to TQ (``cut.capture``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from parkway.actors.roles.controller.controller import SimulatedCrash
from parkway.brokers.base import Envelope, Lane
from parkway.brokers.memory import MemoryBroker
from parkway.protocol.messages import CONTROL_COMMANDS
from parkway.protocol.signing import TYPE_HEADER

from tests.support.embedded import SNAPSHOT_RUN, embedded_run

COMMANDS = {cls.__name__ for cls in CONTROL_COMMANDS}


def record_publishes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Lane]]:
    """Every message the run publishes, as (address, type, lane), in the order it was published."""
    sent: list[tuple[str, str, Lane]] = []
    real_publish = MemoryBroker.publish

    async def publish(
        self: MemoryBroker, address: str, envelope: Envelope, *, lane: Lane = Lane.DATA
    ) -> None:
        sent.append((address, envelope.headers.get(TYPE_HEADER, ""), lane))
        await real_publish(self, address, envelope, lane=lane)

    monkeypatch.setattr(MemoryBroker, "publish", publish)
    return sent


async def test_a_snapshots_commands_take_the_control_lane_but_the_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = record_publishes(monkeypatch)
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


async def test_a_slow_prepare_renews_the_agents_leases_on_their_control_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agents took over half of the deadline to prepare, so their leases are renewed once, each on
    # its control lane, and the snapshot publishes. TQ, prepared only at capture, gets the renewed
    # deadline with its Prepare and needs no Renew.
    from parkway.actors.roles.agent import Agent
    from parkway.actors.runtime.participant import Participant
    from parkway.protocol.messages import Prepare, Renew

    sent = record_publishes(monkeypatch)
    renewed: list[tuple[str, str]] = []  # (address, phase) at each Renew a participant handled
    on_renew = Participant.on_renew

    async def recorded(self: Participant, command: Renew):
        renewed.append((self.address, self.phases.phase.value))
        return await on_renew(self, command)

    slowed: set[str] = set()  # the first snapshot's agents take 0.6 of its 1 s deadline to prepare
    wait = Agent.wait_until_parked

    async def slow_first(self: Agent, command: Prepare):
        if not slowed or command.checkpoint_id in slowed:
            slowed.add(command.checkpoint_id)
            await asyncio.sleep(0.6)
        return await wait(self, command)

    monkeypatch.setattr(Participant, "on_renew", recorded)
    monkeypatch.setattr(Agent, "parked_now", lambda self, command: None)
    monkeypatch.setattr(Agent, "wait_until_parked", slow_first)
    with pytest.raises(SimulatedCrash):  # stopped right after its first published snapshot
        await embedded_run({**SNAPSHOT_RUN, "prepare_timeout_s": 1.0}, tmp_path, stop_after=1)

    assert sorted(renewed) == [("agent/0", "prepared"), ("agent/1", "prepared")]
    renews = {(address, lane) for address, kind, lane in sent if kind == "Renew"}
    assert renews == {("agent/0", Lane.CONTROL), ("agent/1", Lane.CONTROL)}
