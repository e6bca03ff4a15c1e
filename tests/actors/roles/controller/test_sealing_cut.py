"""Receipts in the cut (docs/snapshots.md#receipts-in-the-cut), in memory with every actor in one
process: a snapshot taken while TQ holds the seals of receipts that arrived does not wait for those
seals; its ledger saves the attempts SEALING, with what a seal needs; the cluster dies with the seals
still held, and the restore seals each of them once, before anything is dispatched, with the same
transcripts as a run that never stopped."""

from __future__ import annotations

import asyncio
from pathlib import Path

from parkway.actors.builtin.trainers import ExampleTrainer
from parkway.actors.roles.controller import Controller
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.run.config import from_dict
from parkway.protocol.anchor import decode_ledger_file
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.layout import LEDGER
from parkway.protocol.ledger import AttemptState, Ledger
from parkway.protocol.messages import Completed, Message, SealRows

from tests.support.embedded import embedded_run, started_cluster

CONFIG = {
    "run": "sealcut",
    "seed": 11,
    "policy": {"host": "inline", "per_token_delay_s": 0.0003},
    "tasks": {"builtin": "bank", "limit": 3},
    "rollout": {"group_size": 3, "max_turns": 4},
    "trainer": {"batch_groups": 1},
    "snapshot_interval_s": 3600.0,  # only the snapshot the test asks for
}


class HeldSeals:
    """TQ's SealRows handler, held: no seal is made and none answered until ``drop``, which ends
    every one held unanswered (what a cluster that dies while its seals are on their way leaves)."""

    def __init__(self, tq: TransferQueue) -> None:
        self.dropped = asyncio.Event()
        self.held: list[str] = []
        tq.handlers[SealRows] = self.handle

    async def handle(self, message: Message) -> Message | None:
        assert isinstance(message, SealRows)
        self.held.append(message.rollout_id)
        await self.dropped.wait()
        raise ProtocolError(ErrorCode.UNAVAILABLE, "this TQ died with the seal")

    def drop(self) -> None:
        self.dropped.set()


def sealing_of(ledger: Ledger) -> set[tuple[str, int]]:
    return {(s.rollout_id, a.index) for s, a in ledger.sealing()}


async def test_a_snapshot_saves_receipts_whose_seal_is_on_its_way_and_the_restore_seals_them_once(
    tmp_path: Path,
) -> None:
    reference = await embedded_run(CONFIG, tmp_path / "reference", snapshots=False)
    config = from_dict(CONFIG)
    state = tmp_path / "state"
    controller, actors, workload = await started_cluster(config, state, ExampleTrainer())
    held = HeldSeals(next(a for a in actors if isinstance(a, TransferQueue)))
    try:
        # Rollouts finish; their receipts arrive and their seals are held in TQ.
        while len(sealing_of(controller.state.ledger)) < 3 or len(held.held) < 3:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # (another task's ledger, and TQ's handler)
        assert controller.counts["rollouts_sealed"] == 0 and len(held.held) >= 3
        published = await controller.take_snapshot()
        assert published is not None, "the snapshot waited for seals on their way, or failed"
        assert controller.counts["rollouts_sealed"] == 0  # not one seal came back meanwhile
        saved = Ledger.load(decode_ledger_file((published.path / LEDGER).read_bytes()).ledger)
        saved_sealing = sealing_of(saved)
        assert len(saved_sealing) >= 3 and not saved_sealing & saved.dispatched()
        for sibling, attempt in saved.sealing():  # what a seal after a restore needs
            assert attempt.staging_keys and attempt.turns == len(attempt.staging_keys), sibling.rollout_id
            assert attempt.reward is not None, sibling.rollout_id
    finally:
        workload.cancel()  # the cluster dies with its seals still held
        held.drop()
        await asyncio.gather(workload, return_exceptions=True)

    again, _, resumed = await started_cluster(config, state, ExampleTrainer())
    summary = await asyncio.wait_for(resumed, 120)
    assert summary.restores == 1
    assert again.counts["seals_finished_at_restore"] == len(saved_sealing)
    # Sealed once each, none restarted: every rollout sealed, none failed, and the transcripts of
    # a run that never stopped.
    assert summary.rollouts_sealed == summary.rollouts_expected == 9 and summary.rollouts_failed == 0
    assert summary.attempts_failed == 0
    assert summary.transcripts_sha256 == reference.transcripts_sha256


class HeldReceipts:
    """The controller's ``Completed`` handler, held: receipts reach the controller and wait there
    unread until ``release`` (what a receipt still on the wire is to a snapshot)."""

    def __init__(self, controller: Controller) -> None:
        self.released = asyncio.Event()
        self.held: list[tuple[str, int]] = []
        self.handle_completed = controller.handlers[Completed]
        controller.handlers[Completed] = self.handle

    async def handle(self, message: Message) -> Message | None:
        assert isinstance(message, Completed)
        self.held.append((message.rollout_id, message.attempt))
        await self.released.wait()
        return await self.handle_completed(message)


async def test_receipts_still_on_the_wire_come_with_the_agents_cut_and_are_sealed_once(
    tmp_path: Path,
) -> None:
    """A snapshot taken while receipts are on their way to the controller does not wait for them: each
    agent's Prepared carries its receipts not yet acknowledged, the ledger takes them as arrived
    (``sealing``, their seals begun), and the copies that arrive later are duplicates. Every rollout is
    sealed once, none redone, with the transcripts of a run that never snapshotted."""
    reference = await embedded_run(CONFIG, tmp_path / "reference", snapshots=False)
    controller, _, workload = await started_cluster(from_dict(CONFIG), tmp_path / "state", ExampleTrainer())
    wire = HeldReceipts(controller)
    try:
        while len(wire.held) < 3:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # (rollouts finishing on their agents)
        on_the_wire = set(wire.held)
        assert on_the_wire <= controller.state.ledger.dispatched()  # not one read yet
        published = await controller.take_snapshot()
        assert published is not None, "the snapshot waited for the receipts on the wire, or failed"
        assert controller.counts["receipts_with_cut"] >= len(on_the_wire)
        saved = Ledger.load(decode_ledger_file((published.path / LEDGER).read_bytes()).ledger)
        states = {saved.sibling(r).attempts[a].state for r, a in on_the_wire}
        assert states <= {AttemptState.SEALING, AttemptState.SEALED}, states  # with what a seal needs
    finally:
        wire.released.set()
    summary = await asyncio.wait_for(workload, 120)
    assert summary.rollouts_sealed == summary.rollouts_expected == 9 and summary.rollouts_failed == 0
    assert summary.attempts_failed == 0 and summary.transcripts_sha256 == reference.transcripts_sha256
    # The copies from the wire sealed nothing again: duplicates, or stale once their group was done.
    late = controller.counts["receipts_duplicate"] + controller.counts["receipts_stale"]
    assert late >= len(on_the_wire), dict(controller.counts)
