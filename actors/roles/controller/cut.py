"""The cut, five steps of the save sequence (docs/snapshots.md#save): its instant (``instant``, the
window), and after it, with admission open: every agent's Prepare (``prepare``), their answers
(``prepared``), the receipts of what no cut holds (``drain_receipts``) and the ledger copied with
TQ's rows at one instant (``capture``).

A Run dispatched after the instant is either in its agent's cut or, reaching it after, named among the
snapshot's ``restarts`` at the capture (docs/snapshots.md#dispatched-after-the-instant).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from parkway.actors.roles.controller import scopes
from parkway.brokers.base import Lane
from parkway.protocol.history import LedgerCaptured
from parkway.protocol.ids import parse_address
from parkway.protocol.messages import AttemptRef, Commit, Prepare, Prepared, Renew
from parkway.protocol.snapshot import SnapshotFailure, Stage, episode_mismatch

if TYPE_CHECKING:
    from parkway.actors.roles.controller.save import SaveAttempt, SaveSequence


async def instant(sequence: SaveSequence, attempt: SaveAttempt, _: tuple[Stage, ...]) -> None:
    """The window: admission closed, the ledger's count of dispatches noted, admission open, in one
    stretch of the event loop (no await: nothing else runs in it, so no Run goes out) that reads one
    counter however many rollouts are in flight. What the cut must account for is read off that mark
    after the window: the attempts running then that were dispatched by it. (Nothing is taken when
    nothing moved since the last snapshot: the progress check before it, with admission open.)"""
    if await sequence.nothing_new(attempt):
        return
    host = sequence.host
    host.close_gate()
    attempt.mark = host.ledger.dispatch_mark()
    host.open_gate()


async def prepare(sequence: SaveSequence, attempt: SaveAttempt, stages: tuple[Stage, ...]) -> None:
    """Each agent's Prepare names the attempts dispatched to it by the instant that its last cut did
    not hold (made now, with admission open, from the instant's mark). They are published in the
    background, awaited at ``prepared``: a Run dispatched since that overtakes one is cut there."""
    [stage] = stages
    make = sequence.scopes.prepares(
        sequence.host.ledger, attempt.mark, attempt.checkpoint_id, attempt.deadline
    )
    made = {address: make(address) for address in sequence.participants.addresses(stage)}
    sequence.host.gate.hold()  # (until they resume: see ``save``)
    sending = asyncio.ensure_future(sequence.participants.send(stage, made.__getitem__, "prepare"))
    sending.add_done_callback(lambda f: f.cancelled() or f.exception())  # (raised where awaited)
    attempt.prepares = sending


async def prepared(sequence: SaveSequence, attempt: SaveAttempt, stages: tuple[Stage, ...]) -> None:
    """With admission open: every agent's cut (and the receipts it carried), then the leases
    renewed once if preparing used more than half of the deadline."""
    assert attempt.prepares is not None
    sent = replace(await attempt.prepares, step="prepared")  # (an answer missing fails this step)
    for address, reply in (await sequence.participants.collect(sent)).items():
        assert isinstance(reply, Prepared)
        attempt.parked += reply.parked
        attempt.boundaries += reply.boundaries_passed
        attempt.park_wait_s = max(attempt.park_wait_s, reply.waited_s)
        attempt.restarts.update((r.rollout_id, r.attempt) for r in reply.restarts)
        cut = sequence.scopes.cut_of(address, reply)  # (changes against no cut it holds: refused)
        attempt.cut.extend(cut.values())
        attempt.episodes.update(cut)
        sequence.host.receipts_with_cut(parse_address(address)[1], reply.receipts)  # (none to drain)
    if attempt.deadline - time.time() < sequence.config.prepare_timeout_s / 2:
        cid, renewed = attempt.checkpoint_id, time.time() + sequence.config.prepare_timeout_s
        attempt.deadline = renewed
        for stage in stages:
            await sequence.participants.ask(
                stage, lambda _a: Renew(checkpoint_id=cid, deadline=renewed), "renew"
            )


async def drain_receipts(sequence: SaveSequence, attempt: SaveAttempt, _: tuple[Stage, ...]) -> None:
    """An attempt dispatched at the cut's instant that no agent's cut holds has finished: its receipt
    is on the wire. Wait for it to arrive (or fail) before the copy, event driven, until the deadline:
    an arrived receipt makes its attempt SEALING, which the ledger's cut saves with what its seal
    needs, so the seal's round trip to TQ is not waited for (a restore seals it again). (An attempt a
    cut holds keeps its receipt until the checkpoint ends. One dispatched after the instant is
    waited for by nothing: see ``capture``.)"""
    while True:
        owed = sequence.host.ledger.dispatched_by(attempt.mark)
        waiting = owed - attempt.episodes - attempt.restarts
        if not waiting:
            return
        remaining = attempt.deadline - time.time()
        if remaining <= 0:
            mismatch = episode_mismatch(attempt.episodes, owed - attempt.restarts)
            raise SnapshotFailure("drain_receipts", f"receipts did not arrive: {mismatch}", transient=True)
        await sequence.host.wait_for_receipts(remaining)


async def capture(sequence: SaveSequence, attempt: SaveAttempt, stages: tuple[Stage, ...]) -> None:
    """The ledger and TQ at one cut: the ledger is copied now, and TQ's Prepare and Commit sent right
    after (receipts drained, the rest held by their agents: a seal still on its way is SEALING in the
    copy, or SEALED with TQ's row made before its reply, so before this Commit reaches TQ). TQ's
    Commit goes on its data lane, behind the staging rows the agents' cuts refer to (each sent to TQ
    before its agent prepared). Rows it holds beyond the cuts are of turns after them; those of attempts
    dispatched after the instant that no cut holds it leaves out (``left_out``). Its answer is collected
    with the commit step's (``commit``)."""
    cid, deadline, location = attempt.checkpoint_id, attempt.deadline, attempt.tmp.name
    attempt.captured = sequence.host.export_ledger()
    attempt.captured_dispatched = dispatched = sequence.host.ledger.dispatched()
    sequence.host.history.record(LedgerCaptured(checkpoint_id=cid, seals=sequence.host.seals))
    # An attempt its agent cut that the controller has given up on since (its group is redone) or
    # never dispatched is not kept: the cut holds exactly the attempts dispatched.
    cut = scopes.kept(attempt.cut, dispatched, sequence.host.ledger, sequence.host.counts)
    attempt.episodes = {(e.rollout_id, e.attempt) for e in cut}
    attempt.cut = list(cut)
    # Dispatched after the cut's instant and in no cut (its Run reached its agent after the Prepare):
    # a restore from this snapshot starts it from its prompt, as attempt N+1 with N fenced, and TQ's
    # cut leaves out any rows it made already.
    after = scopes.after_instant(
        sequence.host.ledger.dispatched_after(attempt.mark), attempt.episodes, sequence.host.counts
    )
    attempt.restarts |= after
    # (A restart-only server's rollouts are its agents' too: in the cuts and the ledger alike.)
    mismatch = episode_mismatch(attempt.episodes, dispatched - after)
    if mismatch:  # checked in memory before any cut is written: an invariant, not a timing
        raise SnapshotFailure(
            "capture", f"saved episodes differ from the ledger: {mismatch}", transient=False
        )
    left_out = tuple(AttemptRef(rollout_id=r, attempt=a) for r, a in sorted(after))
    for stage in stages:
        attempt.in_band = [
            await sequence.participants.send(
                stage, lambda _a: Prepare(checkpoint_id=cid, deadline=deadline), "capture", lane=Lane.DATA
            ),
            await sequence.participants.send(
                stage,
                lambda _a: Commit(checkpoint_id=cid, deadline=deadline, location=location, left_out=left_out),
                "capture",
                lane=Lane.DATA,
            ),
        ]
