"""Participants over the in-memory broker: the phase machine behind real commands, and the races.

Races are forced, not slept into: the participant's hooks wait on events the test controls (like
trio's Sequencer), so each interleaving happens exactly as written.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import msgspec
import pytest
import structlog
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.participant import ENDED_KEPT, ParkReport, Participant
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ErrorCode
from parkway.protocol.messages import (
    Abort,
    AttemptRef,
    Commit,
    Committed,
    EpisodeRef,
    Error,
    Forget,
    Ok,
    Persist,
    Persisted,
    Prepare,
    Prepared,
    Renew,
    Restore,
    Restored,
    Resume,
    Status,
    StatusReport,
)

from tests.support.signed import SECRET
from tests.support.waiting import until

RUN = "unit"
EPISODES = (EpisodeRef(rollout_id="g_g0", attempt=0, replica=0),)


class Gated(Participant):
    """A participant whose parking and releasing the test observes and steers."""

    role = "gated"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.admission_closed = asyncio.Event()
        self.may_park = asyncio.Event()
        self.may_park.set()
        self.releases = 0

    async def close_admission(self) -> None:
        self.admission_closed.set()

    async def wait_until_parked(self, command: Prepare) -> ParkReport:
        await self.may_park.wait()
        return ParkReport(parked=2, boundaries_passed=5)

    async def release(self) -> None:
        self.releases += 1


@pytest.fixture
async def setup(tmp_path: Path):
    hub = MemoryHub()
    async with MemoryBroker(hub, RUN) as broker:
        actor = Gated(broker, secret=SECRET, snapshot_root=tmp_path, lease_grace_s=5.0)
        await actor.start()
        yield actor, Client(broker, secret=SECRET, sender="controller/0"), tmp_path
        await actor.stop()


def soon() -> float:
    return time.time() + 10


async def phase_of(client: Client) -> str:
    reply = await client.request("gated/0", Status(checkpoint_id="s", deadline=soon()))
    assert isinstance(reply, StatusReport)
    return reply.phase


async def test_a_full_cycle_writes_a_verifiable_record_after_the_resume(setup) -> None:
    actor, client, root = setup
    prepared = await client.request("gated/0", Prepare(checkpoint_id="ck-1", deadline=soon()))
    assert prepared == Prepared(checkpoint_id="ck-1", parked=2, boundaries_passed=5)
    committed = await client.request(
        "gated/0", Commit(checkpoint_id="ck-1", deadline=soon(), location="tmp_ck-1", episodes=EPISODES)
    )
    assert isinstance(committed, Committed) and committed.episodes == EPISODES
    assert committed.files == () and not (root / RUN / "tmp_ck-1").exists()  # the cut is in memory
    assert await client.request("gated/0", Resume(checkpoint_id="ck-1", deadline=soon())) == Ok(
        detail="resumed"
    )
    assert await phase_of(client) == "idle" and actor.releases == 1
    # Written after the window, the participant already running on.
    persisted = await client.request(
        "gated/0", Persist(checkpoint_id="ck-1", deadline=soon(), location="tmp_ck-1")
    )
    assert isinstance(persisted, Persisted)
    [digest] = persisted.files
    written = root / RUN / "tmp_ck-1" / "participants" / "gated" / "0" / digest.path
    assert hashlib.sha256(written.read_bytes()).hexdigest() == digest.sha256
    assert msgspec.msgpack.decode(written.read_bytes())[0]["episodes"][0]["rollout_id"] == "g_g0"
    again = await client.request(
        "gated/0", Persist(checkpoint_id="ck-1", deadline=soon(), location="tmp_ck-1")
    )
    assert again == persisted  # a Persist sent again is answered, not written twice


async def test_a_cut_aborted_after_the_resume_is_never_written(setup) -> None:
    _, client, root = setup
    await client.request("gated/0", Prepare(checkpoint_id="ck-5", deadline=soon()))
    await client.request(
        "gated/0", Commit(checkpoint_id="ck-5", deadline=soon(), location="tmp_ck-5", episodes=EPISODES)
    )
    await client.request("gated/0", Resume(checkpoint_id="ck-5", deadline=soon()))
    # The snapshot failed once admission reopened (its ledger could not be written, say).
    aborted = await client.request("gated/0", Abort(checkpoint_id="ck-5", deadline=soon()))
    assert aborted == Ok(detail="aborted: its cut dropped")
    late = await client.request(
        "gated/0", Persist(checkpoint_id="ck-5", deadline=soon(), location="tmp_ck-5")
    )
    assert isinstance(late, Error) and late.code is ErrorCode.STALE_CHECKPOINT
    assert not (root / RUN / "tmp_ck-5").exists()
    never = await client.request(
        "gated/0", Persist(checkpoint_id="ck-6", deadline=soon(), location="tmp_ck-6")
    )
    assert isinstance(never, Error) and never.code is ErrorCode.STALE_CHECKPOINT  # no cut was ever taken


async def test_abort_between_prepared_and_commit(setup) -> None:
    actor, client, root = setup
    assert isinstance(
        await client.request("gated/0", Prepare(checkpoint_id="ck-2", deadline=soon())), Prepared
    )
    aborted = await client.request(
        "gated/0", Abort(checkpoint_id="ck-2", deadline=soon(), reason="agent/1 died")
    )
    assert aborted == Ok(detail="aborted in phase prepared")
    late_commit = await client.request(
        "gated/0", Commit(checkpoint_id="ck-2", deadline=soon(), location="tmp_ck-2", episodes=EPISODES)
    )
    assert isinstance(late_commit, Error) and late_commit.code is ErrorCode.STALE_CHECKPOINT
    assert not (root / RUN / "tmp_ck-2").exists()  # a refused commit writes nothing
    assert await phase_of(client) == "idle" and actor.releases == 1


async def test_abort_while_preparing_answers_the_waiting_prepare(setup) -> None:
    actor, client, _ = setup
    actor.may_park.clear()  # a rollout is still mid-turn
    prepare = asyncio.ensure_future(client.request("gated/0", Prepare(checkpoint_id="ck-3", deadline=soon())))
    await actor.admission_closed.wait()
    assert await phase_of(client) == "preparing"
    assert await client.request("gated/0", Abort(checkpoint_id="ck-3", deadline=soon())) == Ok(
        detail="aborted in phase preparing"
    )
    reply = await prepare
    assert isinstance(reply, Error) and reply.code is ErrorCode.STALE_CHECKPOINT
    assert await phase_of(client) == "idle" and actor.releases == 1


async def test_a_late_prepare_of_an_aborted_id_is_refused(setup) -> None:
    actor, client, _ = setup
    # The controller gave up on ck-4 before its Prepare reached this participant.
    assert await client.request("gated/0", Abort(checkpoint_id="ck-4", deadline=soon())) == Ok(
        detail="fenced: that id can no longer start here"
    )
    late = await client.request("gated/0", Prepare(checkpoint_id="ck-4", deadline=soon()))
    assert isinstance(late, Error) and late.code is ErrorCode.STALE_CHECKPOINT
    assert not actor.admission_closed.is_set()  # it never closed admission for a dead id


async def test_a_resume_redelivered_after_the_participant_resumed(setup) -> None:
    actor, client, _ = setup
    await client.call("gated/0", Prepare(checkpoint_id="ck-5", deadline=soon()))
    await client.call("gated/0", Commit(checkpoint_id="ck-5", deadline=soon(), location="tmp_ck-5"))
    resume = Resume(checkpoint_id="ck-5", deadline=soon())
    first = await client.request("gated/0", resume)
    redelivered = await client.request("gated/0", resume)  # same id, same sender: the cached reply
    from_restarted_controller = await Client(client.broker, secret=SECRET, sender="controller/0-new").request(
        "gated/0", resume
    )
    assert first == redelivered == Ok(detail="resumed")
    assert from_restarted_controller == Ok(detail="ck-5 had already ended")
    assert actor.releases == 1  # released once, however many resumes arrive
    # And the id stays dead: it cannot be prepared again.
    again = await client.request("gated/0", Prepare(checkpoint_id="ck-5", deadline=time.time() + 5))
    assert isinstance(again, Error) and again.code is ErrorCode.STALE_CHECKPOINT


async def test_the_release_follows_the_resume_reply_onto_the_wire(setup) -> None:
    # Releasing wakes every parked rollout; were that first, their next steps would run before the
    # reply went out, and the controller's admission gate would stay closed while they did.
    actor, client, _ = setup
    order: list[str] = []
    send_reply, release = actor._send_reply, actor.release

    async def recorded_send_reply(request, content) -> None:  # type: ignore[no-untyped-def]
        order.append("reply")
        await send_reply(request, content)

    async def recorded_release() -> None:
        order.append("release")
        await release()

    actor._send_reply, actor.release = recorded_send_reply, recorded_release  # type: ignore[method-assign]
    await client.call("gated/0", Prepare(checkpoint_id="ck-9", deadline=soon()))
    await client.call("gated/0", Commit(checkpoint_id="ck-9", deadline=soon(), location="tmp_ck-9"))
    order.clear()
    assert await client.request("gated/0", Resume(checkpoint_id="ck-9", deadline=soon())) == Ok(
        detail="resumed"
    )
    await until(lambda: actor.releases == 1)
    assert order == ["reply", "release"]


async def test_a_second_checkpoint_conflicts_with_the_active_one(setup) -> None:
    _, client, _ = setup
    await client.call("gated/0", Prepare(checkpoint_id="ck-6", deadline=soon()))
    other = await client.request("gated/0", Prepare(checkpoint_id="ck-7", deadline=soon()))
    assert isinstance(other, Error) and other.code is ErrorCode.CHECKPOINT_CONFLICT and "ck-6" in other.detail


async def test_a_prepare_that_cannot_park_in_time_is_retryable(setup) -> None:
    actor, client, _ = setup
    actor.may_park.clear()
    reply = await client.request("gated/0", Prepare(checkpoint_id="ck-8", deadline=time.time() + 0.2))
    assert isinstance(reply, Error) and reply.code is ErrorCode.DEADLINE_EXCEEDED and reply.retryable
    actor.may_park.set()  # the retry with a new deadline, same id, parks
    retried = await client.request("gated/0", Prepare(checkpoint_id="ck-8", deadline=soon()))
    assert isinstance(retried, Prepared)


async def test_a_lost_resume_costs_the_lease_not_minutes(tmp_path: Path) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Gated(broker, secret=SECRET, snapshot_root=tmp_path, lease_grace_s=0.05)
        await actor.start()
        client = Client(broker, secret=SECRET, sender="controller/0")
        await client.call("gated/0", Prepare(checkpoint_id="ck-9", deadline=time.time() + 0.2))
        await until(lambda: actor.releases == 1)  # nobody sends Resume: the lease lapses, it resumes itself
        assert await phase_of(client) == "idle"
        late = await client.request(
            "gated/0", Commit(checkpoint_id="ck-9", deadline=time.time() + 5, location="tmp_ck-9")
        )
        assert isinstance(late, Error) and late.code is ErrorCode.STALE_CHECKPOINT
        await actor.stop()


async def test_renew_extends_the_lease(setup) -> None:
    actor, client, _ = setup
    await client.call("gated/0", Prepare(checkpoint_id="ck-10", deadline=time.time() + 5))
    before = actor.phases.lease_expires_at
    await client.call("gated/0", Renew(checkpoint_id="ck-10", deadline=time.time() + 60))
    assert actor.phases.lease_expires_at > before


async def test_restore_then_resume(setup) -> None:
    actor, client, _ = setup
    restored = await client.request(
        "gated/0", Restore(checkpoint_id="rs-1", deadline=soon(), location="snapshot_3")
    )
    assert isinstance(restored, Restored)
    assert await phase_of(client) == "restored"
    assert await client.request("gated/0", Resume(checkpoint_id="rs-1", deadline=soon())) == Ok(
        detail="resumed"
    )
    assert actor.releases == 1


async def test_a_restore_drops_the_fences_of_the_timeline_that_died(setup) -> None:
    # Found by parkway chaos: a live TQ kept the fence of an attempt the dead controller had given up
    # after the snapshot; the restored ledger gave that attempt number out again and TQ dropped all of
    # its rows, so every later snapshot failed validation. The controller fences the restored timeline's
    # dead attempts right after the restore.
    actor, client, _ = setup
    actor.retired.update({("g_g0", 2), ("g_g1", 0)})
    restored = await client.request(
        "gated/0", Restore(checkpoint_id="rs-9", deadline=soon(), location="snapshot_3")
    )
    assert isinstance(restored, Restored) and not actor.retired


async def test_phase_logs_carry_the_checkpoint_id(setup) -> None:
    _, client, _ = setup
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        await client.call("gated/0", Prepare(checkpoint_id="ck-11", deadline=soon()))
    phases = [e for e in logs if e["event"] == "phase"]
    assert [(e["before"], e["after"]) for e in phases] == [("idle", "preparing"), ("preparing", "prepared")]
    assert all(e["checkpoint_id"] == "ck-11" and e["actor"] == "gated/0" for e in phases)


async def test_a_forget_sent_again_runs_again_and_keeps_no_reply(setup) -> None:
    # Forget is idempotent: a duplicate forgets the same attempts once more, and neither reply takes
    # room in the reply cache (one came per batch of rollouts and filled it over a long run).
    actor, client, _ = setup
    forget = Forget(
        checkpoint_id="fg-1", deadline=soon(), attempts=(AttemptRef(rollout_id="g_g0", attempt=0),)
    )
    first = await client.request("gated/0", forget)
    again = await client.request("gated/0", forget)
    assert first == again == Ok(detail="forgot 1")
    assert actor.counts["Forget"] == 2 and actor.counts.get("replayed", 0) == 0
    assert ("g_g0", 0) in actor.forgotten and len(actor.replies) == 0


async def test_the_replies_of_long_ended_checkpoints_are_let_go(setup) -> None:
    # Each checkpoint left a Resume reply behind; a participant keeps those of its last ENDED_KEPT
    # checkpoints (a re-sent Resume is replayed), older ones go with their end record (a Resume that
    # late is answered "already ended", released nothing twice). Persist's journaled replies stay to the
    # journal's own bounds.
    actor, client, _ = setup
    cycles = ENDED_KEPT + 10
    for n in range(cycles):
        cid = f"ck-{n}"
        await client.call("gated/0", Prepare(checkpoint_id=cid, deadline=soon()))
        await client.call("gated/0", Commit(checkpoint_id=cid, deadline=soon(), location=f"tmp_{cid}"))
        await client.call("gated/0", Resume(checkpoint_id=cid, deadline=soon()))
    resumes = sorted(int(k[0].removeprefix("ck-")) for k in actor.replies._entries if k[1] == "Resume")
    assert resumes == list(range(cycles - ENDED_KEPT, cycles))
    assert actor.releases == cycles
    late = await client.request("gated/0", Resume(checkpoint_id="ck-0", deadline=soon()))
    assert late == Ok(detail="ck-0 had already ended") and actor.releases == cycles
    kept = await client.request("gated/0", Resume(checkpoint_id=f"ck-{cycles - 1}", deadline=soon()))
    assert kept == Ok(detail="resumed") and actor.counts["replayed"] == 1
