"""An actor's two lanes on the in-memory broker: the client picks a message's lane by its type (or as
told), and the actor consumes both lanes through one pipeline, so a control command is answered while
its data lane is stuck, and a stop drains both."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from parkway.actors.runtime.actor import Actor
from parkway.actors.runtime.client import Client, lane_of
from parkway.brokers.base import Lane
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import (
    CONTROL_COMMANDS,
    Ack,
    AttemptRef,
    ControlCommand,
    Discover,
    LoadWeights,
    MemoryReport,
    Message,
    Probe,
    ProbeResult,
    Restore,
    Run,
    Snapshot,
    Status,
)

from tests.support.signed import SECRET
from tests.support.waiting import until

RUN = "lanes"


class Stuck(Actor):
    """An agent whose ``Ack`` handler waits until ``unstick`` is set: its data lane can be held full."""

    role = "agent"
    prefetch = 1

    def __init__(self, broker: MemoryBroker) -> None:
        super().__init__(broker, secret=SECRET)
        self.unstick = asyncio.Event()
        self.acks: list[Ack] = []
        self.handlers[Ack] = self.on_ack

    async def on_ack(self, ack: Ack) -> None:
        self.acks.append(ack)
        await self.unstick.wait()


def ack(n: int) -> Ack:
    return Ack(receipts=(AttemptRef(rollout_id=f"r{n}_g0", attempt=0),))


def probe(cid: str, **kwargs: object) -> Probe:
    return Probe(checkpoint_id=cid, deadline=time.time() + 10, **kwargs)  # type: ignore[arg-type]


def filled_in(cls: type[ControlCommand]) -> ControlCommand:
    """An instance of control command ``cls``, its required fields filled in."""
    location = "snapshot_1" if cls is Restore else "tmp_ck-1"  # a Restore names a published snapshot
    values = {"checkpoint_id": "ck-1", "deadline": time.time() + 10, "location": location}
    values |= {"directory": "weights", "policy_version": 1}
    return cls(**{f.name: values[f.name] for f in msgspec.structs.fields(cls) if f.required})


def test_every_control_command_goes_on_the_control_lane_and_the_rest_on_the_data_lane() -> None:
    assert {Status, Discover, MemoryReport, Probe, Snapshot, LoadWeights} <= set(CONTROL_COMMANDS)
    commands: list[Message] = [filled_in(cls) for cls in CONTROL_COMMANDS]
    data: list[Message] = [ack(0), Run(rollout_id="r_g0", attempt=0, group_id="g", env="counter", prompt="p")]
    assert [lane_of(m) for m in commands] == [Lane.CONTROL] * len(commands)
    assert [lane_of(m) for m in data] == [Lane.DATA] * len(data)
    for message in [*commands, *data]:
        for told in Lane:
            assert lane_of(message, told) is told  # the sender's choice wins


@pytest.fixture
async def hub() -> MemoryHub:
    return MemoryHub()


async def test_a_command_is_answered_while_the_data_lane_is_stuck(hub: MemoryHub) -> None:
    async with MemoryBroker(hub, RUN) as server, MemoryBroker(hub, RUN) as requester:
        actor = Stuck(server)
        await actor.start()
        controller = Client(requester, secret=SECRET, sender="controller/0")
        for n in range(2):  # the first holds the data lane's only slot, the second waits behind it
            await controller.send("agent/0", ack(n), correlation_id=f"ack-{n}")
        await until(lambda: len(actor.acks) == 1)
        asking = asyncio.ensure_future(controller.request("agent/0", probe("p-1", work_s=0.2)))
        await until(lambda: actor.in_flight == 2)  # one on each lane
        assert isinstance(await asking, ProbeResult)  # past the data lane
        assert len(actor.acks) == 1
        # A control command sent on the data lane on purpose is ordered behind the data queued there.
        behind = asyncio.ensure_future(controller.request("agent/0", probe("p-2"), lane=Lane.DATA))
        await asyncio.sleep(0.05)
        assert not behind.done()
        actor.unstick.set()
        assert isinstance(await behind, ProbeResult)
        assert len(actor.acks) == 2
        await actor.stop()


async def test_stop_drains_both_lanes_and_leaves_what_did_not_start(hub: MemoryHub) -> None:
    async with MemoryBroker(hub, RUN) as server, MemoryBroker(hub, RUN) as requester:
        actor = Stuck(server)
        actor.control_prefetch = 1
        await actor.start()
        controller = Client(requester, secret=SECRET, sender="controller/0")
        for n in range(2):
            await controller.send("agent/0", ack(n), correlation_id=f"ack-{n}")
        slow = asyncio.ensure_future(controller.request("agent/0", probe("p-slow", work_s=0.2)))
        queued = asyncio.ensure_future(controller.request("agent/0", probe("p-next")))
        await until(lambda: actor.in_flight == 2)
        stopping = asyncio.ensure_future(actor.stop())
        await asyncio.sleep(0.05)
        assert not stopping.done()  # the Ack in progress holds the stop
        actor.unstick.set()
        await stopping
        assert isinstance(await slow, ProbeResult)  # finished and answered
        assert not queued.done()  # not started: left on its queue
        assert [a.receipts[0].rollout_id for a in actor.acks] == ["r0_g0"]
        assert [len(hub.queues[(RUN, "agent/0", lane)].messages) for lane in Lane] == [1, 1]
        successor = Stuck(server)
        successor.unstick.set()
        await successor.start()
        assert isinstance(await queued, ProbeResult)  # redelivered to the next process
        await until(lambda: [a.receipts[0].rollout_id for a in successor.acks] == ["r1_g0"])
        await successor.stop()
