"""Snapshot and restore end to end on the in-memory broker.

The cluster "dies" right after a snapshot is published (``SimulatedCrash``: every actor and all their
memory are dropped); a fresh cluster restores the snapshot and finishes the run. The real-process,
real-signal version of this lives in ``tests/integration``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from parkway.actors.launch.workload import run_workload
from parkway.actors.roles.controller.controller import RunSummary, SimulatedCrash
from parkway.actors.run.config import from_dict
from parkway.actors.run.tasks import load_tasks
from parkway.actors.runtime.client import Client
from parkway.brokers.memory import MemoryBroker, MemoryHub

from tests.support.embedded import embedded_run
from tests.support.signed import SECRET

BASE = {
    "run": "rec",
    "seed": 3,
    # Slow enough that a snapshot finds rollouts mid-flight: they run on while it is written.
    "policy": {"host": "inline", "per_token_delay_s": 0.001},
    "tasks": {"builtin": "bank", "limit": 3},
    "rollout": {"group_size": 3, "max_turns": 6},
    "snapshot_interval_s": 0.05,
}


async def run(
    state: Path, *, stop_after: int | None = None, snapshots: bool = True, **overrides: object
) -> RunSummary:
    return await embedded_run({**BASE, **overrides}, state, snapshots=snapshots, stop_after=stop_after)


async def test_snapshots_do_not_change_what_is_generated(tmp_path: Path) -> None:
    plain = await run(tmp_path / "plain", snapshots=False)
    snapshotted = await run(tmp_path / "snap")
    assert snapshotted.snapshots_published >= 2
    assert snapshotted.transcripts_sha256 == plain.transcripts_sha256
    assert snapshotted.pause_ms["max"] > 0


@pytest.mark.parametrize("level", ["turn", "sibling", "prompt_group"])
async def test_a_crash_after_a_snapshot_continues_from_the_last_boundary(tmp_path: Path, level: str) -> None:
    reference = await run(tmp_path / "reference", snapshots=False)
    state = tmp_path / "crashy"
    with pytest.raises(SimulatedCrash):
        await run(state, stop_after=2, recovery={"target_level": level})
    [snapshot] = sorted((state / "snapshots" / "rec").glob("snapshot_*"))[-1:]
    manifest = json.loads((snapshot / "manifest.json").read_text())
    saved = {tuple(e) for e in manifest["episodes"]}
    assert saved, "the crash must hit rollouts mid-flight, or this test proves nothing"

    resumed = await run(state, recovery={"target_level": level})
    assert resumed.restores == 1
    assert resumed.rollouts_sealed == resumed.rollouts_expected == 9 and resumed.rollouts_failed == 0
    assert resumed.mean_reward == 1.0  # every bank session replays to its balances: each transfer once
    assert resumed.sessions_leaked == 0 and resumed.tool_mutations_duplicated == 0
    if level == "turn":
        assert resumed.rollouts_restored == len(saved)
        # Every restored rollout continued: at most its one in-flight model call was generated again.
        assert resumed.turns_regenerated <= len(saved)
        # And the transcripts are exactly those of a run that never crashed.
        assert resumed.transcripts_sha256 == reference.transcripts_sha256
    else:
        assert resumed.rollouts_restored == 0
        assert resumed.turns_regenerated > resumed.rollouts_restored  # sibling: saved turns thrown away
        assert resumed.transcripts_sha256 == reference.transcripts_sha256  # same seeds, same tokens anyway


async def test_a_snapshot_on_demand(tmp_path: Path) -> None:
    import asyncio
    import time

    from parkway.actors.runtime.client import Client
    from parkway.protocol.messages import Snapshot, SnapshotTaken

    config = from_dict(
        {**BASE, "snapshot_interval_s": 3600.0, "policy": {"host": "inline", "per_token_delay_s": 0.002}}
    )
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        workload = asyncio.ensure_future(
            run_workload(broker, SECRET, config, load_tasks(config.tasks), embedded=True, state_root=tmp_path)
        )
        client = Client(broker, secret=SECRET, sender="cli/1")
        reply = None
        for _ in range(200):  # the controller answers once its workload is running
            reply = await client.request(
                "controller/0", Snapshot(checkpoint_id="ask-1", deadline=time.time() + 30)
            )
            if isinstance(reply, SnapshotTaken):
                break
            await asyncio.sleep(0.05)
        summary = await workload
    assert isinstance(reply, SnapshotTaken) and reply.snapshot == "snapshot_1" and not reply.skipped
    assert summary.snapshots_published == 1 and summary.rollouts_sealed == 9


async def test_trainer_checkpoints_anchor_snapshots(tmp_path: Path) -> None:
    summary = await run(tmp_path, trainer={"batch_groups": 1, "checkpoint_every": 1})
    trainer_dir = tmp_path / "snapshots" / "rec" / "trainer"
    assert sorted(p.name for p in trainer_dir.glob("step_*")) == [
        "step_1.msgpack",
        "step_2.msgpack",
        "step_3.msgpack",
    ]
    assert sorted(p.name for p in trainer_dir.glob("fallback_*")) == [
        "fallback_1.msgpack",
        "fallback_2.msgpack",
        "fallback_3.msgpack",
    ]
    assert summary.train_steps == 3 and summary.rollouts_sealed == 9


async def test_a_trainer_checkpoint_without_its_snapshot_falls_back(tmp_path: Path, monkeypatch) -> None:
    # The crash comes after the fallback marker and the trainer's state are written, before the snapshot
    # anchored at that step: the restore keeps the group the trainer consumed and restarts the others.
    from parkway.actors.roles.controller.snapshots import SnapshotCoordinator

    original = SnapshotCoordinator.write_trainer_checkpoint

    def then_crash(self, step, *, anchor, state):
        original(self, step, anchor=anchor, state=state)
        raise SimulatedCrash(f"died right after trainer checkpoint {step}")

    monkeypatch.setattr(SnapshotCoordinator, "write_trainer_checkpoint", then_crash)
    overrides = {"trainer": {"batch_groups": 1, "checkpoint_every": 1}}
    with pytest.raises(SimulatedCrash):
        await run(tmp_path, **overrides)
    monkeypatch.setattr(SnapshotCoordinator, "write_trainer_checkpoint", original)
    resumed = await run(tmp_path, **overrides)
    assert resumed.restores == 1
    assert resumed.train_steps == 3 and resumed.policy_version == 3  # 1 step before the crash, 2 after
    assert resumed.rollouts_sealed == 9 and resumed.rollouts_failed == 0
    assert resumed.attempts_dispatched == 9 + 6  # all 9 before the crash; after it, not the consumed group


async def test_a_corrupt_newest_snapshot_falls_back_to_the_one_before(tmp_path: Path) -> None:
    import structlog

    with pytest.raises(SimulatedCrash):
        await run(tmp_path, stop_after=2)
    run_dir = tmp_path / "snapshots" / "rec"
    newest = sorted(run_dir.glob("snapshot_*"))[-1]
    ledger = newest / "ledger.msgpack"
    data = bytearray(ledger.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit's worth of damage
    ledger.write_bytes(bytes(data))
    with structlog.testing.capture_logs() as logs:
        resumed = await run(tmp_path, snapshot_interval_s=0.2)  # tuning may change; the work may not
    [skipped] = [e for e in logs if e["event"] == "snapshot_skipped" and e.get("snapshot") == newest.name]
    assert "ledger.msgpack does not match its sha256" in skipped["reason"]
    restored = [e for e in logs if e["event"] == "restore_started"]
    assert restored and restored[0]["snapshot"] != newest.name  # the one before was restored
    assert resumed.restores == 1 and resumed.rollouts_sealed == 9


async def test_a_snapshot_of_other_work_is_not_restored(tmp_path: Path) -> None:
    with pytest.raises(SimulatedCrash):
        await run(tmp_path, stop_after=1)
    other = await run(tmp_path, seed=99)  # another seed is other work: start afresh
    assert other.restores == 0 and other.rollouts_sealed == 9


@pytest.mark.parametrize("code", ["unavailable", "invalid_phase"])
async def test_an_orphaned_checkpoint_whose_abort_is_refused_fails_the_start_by_name(
    tmp_path: Path, monkeypatch, code: str
) -> None:
    # A controller died after preparing the policy under its checkpoint: the next controller aborts
    # that id before anything else. When the policy refuses that Abort, the start fails with a
    # SnapshotFailure naming the participant and its reason (it died with a TypeError before). The
    # failure is transient exactly when the refusal is retryable: then starting again may succeed.
    import time

    from parkway.actors.runtime.participant import Participant
    from parkway.protocol.errors import ErrorCode, ProtocolError
    from parkway.protocol.messages import Prepare, Prepared
    from parkway.protocol.snapshot import SnapshotFailure

    dead = "ck-20240101T000000.000-dead00"
    start, abort = Participant.start, Participant.on_abort

    async def start_then_prepare(self: Participant) -> None:
        await start(self)
        if self.address == "policy/0":  # what the dead controller left behind
            prepare = Prepare(checkpoint_id=dead, deadline=time.time() + 60)
            dead_controller = Client(self.broker, keyring=self.client.keyring, sender="controller/0")
            assert isinstance(await dead_controller.request(self.address, prepare), Prepared)

    async def refuse(self: Participant, command):  # type: ignore[no-untyped-def]
        if command.checkpoint_id == dead:
            raise ProtocolError(ErrorCode(code), "the disk under the snapshot root is read-only")
        return await abort(self, command)

    monkeypatch.setattr(Participant, "start", start_then_prepare)
    monkeypatch.setattr(Participant, "on_abort", refuse)
    # A transient failure is retried until the cluster wait is over (the dead prepare's lease lapses
    # first, and the restore then succeeds): this asks how the failure reads once retrying is over.
    from parkway.actors.roles.controller import snapshots

    monkeypatch.setattr(snapshots, "RESTORE_RETRY_FIRST_S", 1e9)
    with pytest.raises(SnapshotFailure) as failed:
        await run(tmp_path)
    assert failed.value.step == "abort_orphan"
    assert failed.value.detail == f"policy/0: {code}: the disk under the snapshot root is read-only"
    assert failed.value.transient is (code == "unavailable")  # only unavailable is retryable


async def test_the_save_and_the_restore_walk_their_sequences_in_order(tmp_path: Path, monkeypatch) -> None:
    # The order, and the stages of each step, are read from protocol/snapshot.py, nowhere else.
    from parkway.actors.roles.controller import restore, save
    from parkway.protocol.snapshot import RESTORE_SEQUENCE, SAVE_SEQUENCE, SaveStep

    ran: list[tuple[str, object, tuple[str, ...]]] = []
    for table in (save.SAVE_STEPS, restore.RESTORE_STEPS):
        for name, implementation in list(table.items()):

            async def recorded(self, attempt, stages, name=name, implementation=implementation):  # type: ignore[no-untyped-def]
                ran.append((getattr(attempt, "checkpoint_id", "restore"), name, stages))
                await implementation(self, attempt, stages)

            monkeypatch.setitem(table, name, recorded)
    with pytest.raises(SimulatedCrash):
        await run(tmp_path, stop_after=1)
    until_publish = [(s.name, s.stages) for s in SAVE_SEQUENCE][
        : [s.name for s in SAVE_SEQUENCE].index(SaveStep.PUBLISH) + 1
    ]
    first = [s.name for s in RESTORE_SEQUENCE[:2]]
    assert [n for who, n, _ in ran if who == "restore"] == first  # nothing on disk: no snapshot selected
    assert [(n, st) for who, n, st in ran if who != "restore"] == until_publish  # then the crash

    ran.clear()
    resumed = await run(tmp_path)
    assert resumed.restores == 1 and resumed.snapshots_published >= 1
    assert [(n, st) for who, n, st in ran if who == "restore"] == [
        (s.name, s.stages) for s in RESTORE_SEQUENCE
    ]
    published = {who for who, n, _ in ran if n is SaveStep.PREPARE}  # (not skipped)
    assert published
    for checkpoint_id in published:
        assert [(n, st) for who, n, st in ran if who == checkpoint_id] == [
            (s.name, s.stages) for s in SAVE_SEQUENCE
        ]
