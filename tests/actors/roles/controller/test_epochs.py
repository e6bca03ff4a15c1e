"""The epoch a restore runs at: above the snapshot's anchor and above every epoch a participant reports,
so restoring the same snapshot twice never hands the second timeline the first one's epoch."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
from parkway.actors.roles.controller.state import RunState
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.runtime.client import Client
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.anchor import ControllerAnchor
from parkway.protocol.messages import Restore, Restored, StatusReport
from parkway.protocol.messages import Status as StatusCommand

SECRET = b"epoch-test"


def anchor(epoch: int) -> ControllerAnchor:
    return ControllerAnchor(
        policy_version=0,
        epoch=epoch,
        train_steps=0,
        next_task=0,
        first_in_play=0,
        sealed=0,
        reward_sum=0.0,
        transcripts=f"{0:064x}",
        trained_groups=[],
        counts={},
    )


def test_a_restore_runs_above_the_anchor_and_above_what_participants_saw() -> None:
    fresh = RunState()
    fresh.take_anchor(anchor(1), task_count=1)
    assert fresh.epoch == 2
    again = RunState()
    again.epochs_seen = 2  # the participants were restored to epoch 2 by a controller that died since
    again.take_anchor(anchor(1), task_count=1)  # the same snapshot once more
    assert again.epoch == 3


async def test_a_participant_reports_the_epoch_a_restore_took_it_to(tmp_path: Path) -> None:
    tq_dir = tmp_path / "ep" / "snapshot_1" / "tq"
    tq_dir.mkdir(parents=True)
    for name in ("staging.msgpack", "canonical.msgpack", "lineage.msgpack"):
        (tq_dir / name).write_bytes(msgspec.msgpack.encode([]))
    async with MemoryBroker(MemoryHub(), "ep") as broker:
        tq = TransferQueue(broker, secret=SECRET, snapshot_root=tmp_path)
        await tq.start()
        client = Client(broker, secret=SECRET, sender="controller/0")
        before = await client.request("tq/0", StatusCommand(checkpoint_id="s-1", deadline=time.time() + 5))
        restore = Restore(checkpoint_id="r-1", deadline=time.time() + 5, location="snapshot_1", epoch=4)
        assert isinstance(await client.request("tq/0", restore), Restored)
        after = await client.request("tq/0", StatusCommand(checkpoint_id="s-2", deadline=time.time() + 5))
        await tq.stop()
    assert isinstance(before, StatusReport) and isinstance(after, StatusReport)
    assert (before.epoch, after.epoch) == (0, 4)
