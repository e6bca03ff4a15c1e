"""One coordinated snapshot: the save sequence of ``protocol/snapshot.py``, step by step.

``SAVE_STEPS`` maps every ``SaveStep`` to its implementation (checked at import); ``SaveSequence.save``
walks ``SAVE_SEQUENCE`` in order with one ``SaveAttempt`` that the steps fill in. A failure at a step
that ``save_failure_aborts`` is aborted under the snapshot's id everywhere and its temporary directory
deleted; the previous snapshot stays authoritative. ``save`` returns what it published, or why it
skipped.

The admission-closed window holds only the cut's instant: the ledger's count of dispatches, noted in
one stretch of the event loop. Every agent's Prepare is made from that mark and published, the agents'
cuts come back, the receipts they leave out arrive and the ledger is copied with admission open; an
attempt dispatched after the instant is in
the snapshot if its agent cut it, and restarts from its prompt at a restore if not. Writing, fsyncing,
validating and publishing follow, their blocking file work in worker threads so the controller's event
loop keeps dispatching (docs/snapshots.md#the-window).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from parkway.actors.roles.controller import cut, scopes
from parkway.actors.roles.controller.fingerprints import expected_topology, fingerprint, replica_counts
from parkway.actors.roles.controller.host import SnapshotHost
from parkway.actors.roles.controller.metrics import SnapshotMetrics
from parkway.actors.roles.controller.participants import Participants, Sent
from parkway.actors.roles.controller.snapshot_files import check_files
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime import tracing
from parkway.actors.runtime.memory import trim_heap
from parkway.actors.storage.publish import prune, publish, write_ledger_file
from parkway.actors.storage.runs import RunDirectory
from parkway.protocol.anchor import LedgerFile
from parkway.protocol.history import (
    SnapshotAborted,
    SnapshotDone,
    SnapshotFailed,
    SnapshotPublished,
    SnapshotSkipped,
    SnapshotStep,
)
from parkway.protocol.ids import Role, new_checkpoint_id, parse_address
from parkway.protocol.layout import participant_dir
from parkway.protocol.manifest import SCHEMA, Manifest, ManifestFile, TrainerMark
from parkway.protocol.messages import (
    Commit,
    Committed,
    EpisodeRef,
    FileDigest,
    Persist,
    Persisted,
    Prepare,
    Prepared,
    StatusReport,
)
from parkway.protocol.snapshot import (
    SAVE_SEQUENCE,
    SaveStep,
    SnapshotFailure,
    Stage,
    check_step_table,
    episode_mismatch,
    save_failure_aborts,
)
from parkway.protocol.tracecontext import checkpoint_trace_id, trace_id_hex

log = structlog.get_logger("parkway.snapshots")

# After the window nothing waits on the snapshot: a request the broker refuses (it is restarting) is
# sent again for this long before the snapshot fails.
AFTER_WINDOW_RETRY_S = 30.0

# What a snapshot would capture, in counters: the boundaries agents passed (turns move without any
# ledger or TQ change) and the ledger's own movement. Equal to the last published one: nothing to save.
Progress = tuple[int, ...]


@dataclass(frozen=True)
class Published:
    """A snapshot that was published (the answer of ``parkway snapshot`` is made from it)."""

    checkpoint_id: str
    seq: int
    path: Path  # its ``snapshot_<seq>`` directory
    episodes: int  # rollouts saved
    bytes: int  # every file and the manifest
    created_at: float  # the manifest's

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class Skipped:
    """A snapshot attempt that saved nothing: nothing moved since the last one."""

    checkpoint_id: str
    reason: str


SaveOutcome = Published | Skipped


@dataclass
class SaveAttempt:
    """One save, as its steps fill it in."""

    checkpoint_id: str
    seq: int
    tmp: Path  # ``tmp_<checkpoint id>``, renamed to ``snapshot_<seq>`` when published
    deadline: float  # one for every participant's prepare and commit (renewed once if need be)
    force: bool  # taken even when nothing moved
    files: list[ManifestFile] = field(default_factory=list)
    episodes: set[tuple[str, int]] = field(default_factory=set)  # what the agents saved
    cut: list[EpisodeRef] = field(default_factory=list)  # the same, each at its boundary (tool calls)
    captured_dispatched: set[tuple[str, int]] = field(default_factory=set)  # the ledger's, at the cut
    mark: int = 0  # the ledger's count of dispatches at the cut's instant (``Ledger.dispatch_mark``)
    prepares: asyncio.Future[Sent] | None = None  # the agents' Prepares, sent and answered after the window
    in_band: list[Sent] = field(default_factory=list)  # TQ's Prepare and Commit, answered after the window
    # What restarts from its prompt at a restore: what restart-only ones could not save, and attempts
    # dispatched after the cut's instant that no agent's cut holds.
    restarts: set[tuple[str, int]] = field(default_factory=set)
    parked: int = 0
    boundaries: int = 0
    park_wait_s: float = 0.0  # the longest an agent waited for its rollouts to reach a boundary
    bytes: int = 0  # what the published snapshot holds: every file and the manifest
    bytes_written: int = 0  # of which written by it (the rest is packs linked from the snapshot before)
    steps_ms: dict[str, float] = field(default_factory=dict)
    progress: Progress | None = None
    skip_reason: str | None = None  # set by the first step when there is nothing to save
    captured: LedgerFile | None = None  # the ledger and anchor at the cut
    published: Published | None = None


class SaveSequence:
    def __init__(
        self,
        host: SnapshotHost,
        config: RunConfig,
        run: RunDirectory,
        participants: Participants,
        metrics: SnapshotMetrics,
        config_fingerprint: str,
    ) -> None:
        self.host, self.config, self.run = host, config, run
        self.participants, self.metrics, self.config_fingerprint = participants, metrics, config_fingerprint
        self.last_progress: Progress | None = None
        # The newest snapshot this controller published: participants link from it what did not change.
        self.base: str | None = None
        self.on_published: Callable[[Published], None] | None = None  # a test hook
        self.aborting: asyncio.Task[None] | None = None  # the last aborted snapshot's abort round
        self.scopes = scopes.DispatchedScopes()

    async def progress(self) -> Progress:
        boundaries = 0
        for address in self.participants.replicas(Role.AGENT):
            reply = await self.participants.status(address, "progress")
            if isinstance(reply, StatusReport):
                boundaries += reply.counts.get("boundaries", 0)
                self.host.observe(address, reply)
        counts = self.host.counts
        return (
            boundaries,
            counts["attempts_dispatched"],
            counts["rollouts_sealed"],
            counts["attempts_failed"],
            counts["train_steps"],
            len(self.host.ledger.groups),
        )

    async def remember_progress(self) -> None:
        """What a restore continues from counts as saved: the next snapshot needs movement after it."""
        self.last_progress = await self.progress()

    async def save(self, *, force: bool = False, checkpoint_id: str | None = None) -> SaveOutcome:
        """One snapshot attempt. Raises SnapshotFailure. ``force`` takes it even when nothing moved (a
        trainer checkpoint needs its own snapshot); ``checkpoint_id`` names it (``parkway snapshot
        --checkpoint-id``), a fresh id otherwise."""
        await self.settle_abort()  # (before anything of this snapshot: the gate is open meanwhile)
        cid = checkpoint_id or new_checkpoint_id("ck")
        self.participants.began = time.time()
        seq = self.run.next_seq()
        attempt = SaveAttempt(
            checkpoint_id=cid,
            seq=seq,
            tmp=self.run.tmp(cid),
            deadline=time.time() + self.config.prepare_timeout_s,
            force=force,
        )
        started = time.perf_counter()
        host, history = self.host, self.host.history
        paused_before = host.paused_s()  # the gate's own clock measures the admission-closed window
        with (
            structlog.contextvars.bound_contextvars(checkpoint_id=cid),
            tracing.snapshot(cid, kind="snapshot", seq=seq),
        ):
            current = SAVE_SEQUENCE[0].name
            try:
                for step in SAVE_SEQUENCE:
                    current = step.name
                    t0 = time.perf_counter()
                    host.faults.reach(f"save_{step.name.value}")
                    history.record(SnapshotStep(checkpoint_id=cid, step=step.name.value))
                    try:
                        await tracing.step(step.name.value, SAVE_STEPS[step.name](self, attempt, step.stages))
                    except OSError as exc:
                        # Storage (a disk that is full, an I/O error, a failed fsync or rename): the
                        # snapshot is aborted and the next interval tries again.
                        raise SnapshotFailure(step.name.value, f"storage: {exc}", transient=True) from exc
                    took = time.perf_counter() - t0
                    attempt.steps_ms[step.name.value] = round(took * 1000, 3)
                    self.metrics.step_took(step.name.value, took * 1000)
                    host.metrics.snapshot_step(step.name.value, took)
                    if attempt.skip_reason is not None:
                        return self._skipped(attempt)
                    host.faults.reach(f"after_{step.name.value}")
            except SnapshotFailure as failure:
                await self._failed(attempt, current, failure)
                raise
            except asyncio.CancelledError:
                # Cut off mid-way (the run ends on an error): its participants still hear the abort,
                # in the background, and the run's teardown settles that round.
                if save_failure_aborts(current):
                    self._abort_decided(attempt, SnapshotFailure(current.value, "cancelled", transient=True))
                raise
            finally:
                host.gate.release()  # (ended before its resume: failed, skipped or cut off)
                if attempt.prepares is not None and not attempt.prepares.done():
                    attempt.prepares.cancel()  # (the abort round reaches every agent either way)
                window = host.paused_s() - paused_before
                if window > 0 and host.gate_open:  # a skipped snapshot never closed the gate
                    self.metrics.pause_ms.append(window * 1000)
                    host.metrics.snapshot_pause(window)
        assert attempt.published is not None
        self.metrics.records.append(
            {
                "pause_ms": round(window * 1000, 3),
                "rollouts": len(attempt.episodes),
                "parked": attempt.parked,
                "bytes": attempt.bytes,
                "bytes_written": attempt.bytes_written,
                "park_wait_ms": round(attempt.park_wait_s * 1000, 3),
                "steps_ms": attempt.steps_ms,
            }
        )
        self.metrics.published += 1
        host.metrics.snapshot("published")
        self.metrics.streak.published(attempt.published.name, attempt.published.created_at)
        history.record(SnapshotDone(checkpoint_id=cid, snapshot=attempt.published.name))
        log.info(
            "snapshot_published",
            checkpoint_id=cid,
            snapshot=attempt.published.name,
            episodes=len(attempt.episodes),
            ms=round((time.perf_counter() - started) * 1000, 3),
            parked=attempt.parked,
        )
        return attempt.published

    def _skipped(self, attempt: SaveAttempt) -> Skipped:
        assert attempt.skip_reason is not None
        self.host.history.record(SnapshotSkipped(checkpoint_id=attempt.checkpoint_id))
        self.metrics.skipped += 1
        self.host.metrics.snapshot("skipped")
        self.metrics.streak.cleared()
        log.info("snapshot_skipped", reason=attempt.skip_reason)
        return Skipped(checkpoint_id=attempt.checkpoint_id, reason=attempt.skip_reason)

    async def _failed(self, attempt: SaveAttempt, step: SaveStep, failure: SnapshotFailure) -> None:
        self.host.history.record(
            SnapshotFailed(
                checkpoint_id=attempt.checkpoint_id,
                step=failure.step,
                detail=failure.detail,
                transient=failure.transient,
            )
        )
        self.scopes.forget()  # the next Prepares name every Run: an agent may not hold its last cut
        if save_failure_aborts(step):
            self._abort_decided(attempt, failure)
        # Open as soon as the abort is decided: the rollouts go on while the Aborts are in flight
        # (a stopped participant must not hold admission closed) and while snapshots fail.
        self.host.open_gate()
        self.metrics.failed += 1
        self.metrics.streak.failed(failure.step, failure.detail, time.time())
        self.host.metrics.snapshot("failed")

    def _abort_decided(self, attempt: SaveAttempt, failure: SnapshotFailure) -> None:
        """The snapshot is aborted: its temporary directory goes now, and the abort round (``abort``)
        runs in the background under the same id, so the gate need not wait for it."""
        log.warning("snapshot_aborted", step=failure.step, detail=failure.detail, transient=failure.transient)
        self.host.history.record(SnapshotAborted(checkpoint_id=attempt.checkpoint_id, step=failure.step))
        shutil.rmtree(attempt.tmp, ignore_errors=True)
        self.aborting = asyncio.get_running_loop().create_task(self._abort_round(attempt, failure))

    async def _abort_round(self, attempt: SaveAttempt, failure: SnapshotFailure) -> None:
        with structlog.contextvars.bound_contextvars(checkpoint_id=attempt.checkpoint_id):
            await self.abort(attempt, failure)
            log.info("abort_round_ended")
            self.host.faults.reach("after_abort")

    async def abort(self, attempt: SaveAttempt, failure: SnapshotFailure) -> None:
        """Abort under the same id everywhere (fencing it), bounded; delete the temporary directory
        again (a participant that was slow may have written into it since)."""
        await self.participants.abort_everywhere(attempt.checkpoint_id, str(failure))
        shutil.rmtree(attempt.tmp, ignore_errors=True)

    async def settle_abort(self) -> None:
        """Wait for the abort round of the last aborted snapshot (bounded; the gate is open): a
        participant still prepared for that id would refuse to prepare another (``checkpoint_conflict``).
        Raises what the round raised."""
        task, self.aborting = self.aborting, None
        if task is None:
            return
        if not task.done():
            log.info("snapshot_waits_for_abort_round")
        await task

    # -- the steps ------------------------------------------------------------------------------------
    async def nothing_new(self, attempt: SaveAttempt) -> bool:
        """No boundary passed, no ledger or TQ change since the last snapshot: one would add nothing
        (unless forced), and this one is skipped."""
        attempt.progress = await self.progress()
        if self.last_progress == attempt.progress and not attempt.force:
            attempt.skip_reason = "nothing new since the last snapshot"
            return True
        return False

    async def retire(self, attempt: SaveAttempt, _: tuple[Stage, ...]) -> None:
        await self.host.retire_pending()

    async def ack_drain(self, attempt: SaveAttempt, _: tuple[Stage, ...]) -> None:
        await self.host.flush_acks()

    async def commit(self, attempt: SaveAttempt, stages: tuple[Stage, ...]) -> None:
        """After the window: every other participant takes its cut. An agent's Commit names the attempts
        it keeps of the cut it took at Prepare; a tool server's names each with the tool calls its
        boundary holds (it keeps each session as it was there); the tool servers and the policy are
        prepared right before, on the same lane. TQ's answers, to what the window sent, are collected."""
        cid, deadline, location = attempt.checkpoint_id, attempt.deadline, attempt.tmp.name
        cut = tuple(attempt.cut)
        [stage] = stages
        unprepared = tuple(role for role in stage if role is not Role.AGENT)
        prepares = await self.participants.send(
            unprepared, lambda _a: Prepare(checkpoint_id=cid, deadline=deadline), "prepare"
        )
        commits = await self.participants.send(
            stage,
            lambda a: Commit(
                checkpoint_id=cid, deadline=deadline, location=location, episodes=scopes.commit_scope(a, cut)
            ),
            "commit",
        )
        for reply in (await self.participants.collect(prepares)).values():
            assert isinstance(reply, Prepared)
            attempt.restarts.update((r.rollout_id, r.attempt) for r in reply.restarts)
        for address, reply in (await self.participants.collect(commits)).items():
            assert isinstance(reply, Committed)
            if parse_address(address)[0] == Role.AGENT:
                saved = {(e.rollout_id, e.attempt) for e in reply.episodes}
                kept = {(e.rollout_id, e.attempt) for e in scopes.commit_scope(address, cut)}
                if saved != kept:
                    raise SnapshotFailure(
                        "commit", f"{address} committed another cut than it prepared", transient=True
                    )
        for sent in attempt.in_band:
            await self.participants.collect(sent)

    async def resume(self, attempt: SaveAttempt, stages: tuple[Stage, ...]) -> None:
        await self.participants.resume_all(attempt.checkpoint_id, stages, deadline=attempt.deadline)
        self.host.gate.release()

    async def persist(self, attempt: SaveAttempt, stages: tuple[Stage, ...]) -> None:
        """After the window: every participant writes its cut, the controller its ledger copy. Nothing
        waits on it, so a broker restarting meanwhile is waited out rather than failing the snapshot."""
        cid, location = attempt.checkpoint_id, attempt.tmp.name
        deadline = time.time() + self.config.prepare_timeout_s + AFTER_WINDOW_RETRY_S
        assert attempt.captured is not None
        for stage in stages:
            replies = await self.participants.ask(
                stage,
                lambda _a: Persist(checkpoint_id=cid, deadline=deadline, location=location, base=self.base),
                "persist",
                retry_for_s=AFTER_WINDOW_RETRY_S,
            )
            for address, reply in replies.items():
                assert isinstance(reply, Persisted)
                record_files(attempt, address, reply.files, reply.checkpoint_id)
        ledger = await asyncio.to_thread(
            write_ledger_file, attempt.tmp, attempt.captured, cid, self.host.faults
        )
        attempt.files.append(ledger)

    async def validate(self, attempt: SaveAttempt, _: tuple[Stage, ...]) -> None:
        # An agent that died and came back lost its rollouts.
        for address in self.participants.replicas(Role.AGENT):
            reply = await self.participants.status(address, "alive", retry_for_s=AFTER_WINDOW_RETRY_S)
            if isinstance(reply, StatusReport) and self.host.observe(address, reply):
                raise SnapshotFailure("validate", f"{address} restarted during the snapshot", transient=True)
        # The ledger copied at the cut against what the agents' cuts hold (checked at the commit too).
        restarts = attempt.restarts  # restart-only participants' rollouts: not kept, not compared
        assert attempt.captured is not None
        mismatch = episode_mismatch(attempt.episodes - restarts, attempt.captured_dispatched - restarts)
        if mismatch:
            raise SnapshotFailure(
                "validate", f"saved episodes differ from the ledger: {mismatch}", transient=False
            )
        base = self.run.path / self.base if self.base else None
        problem = await asyncio.to_thread(check_files, attempt.tmp, attempt.files, base)
        if problem is not None:
            detail, transient = problem
            raise SnapshotFailure("validate", detail, transient=transient)

    async def publish(self, attempt: SaveAttempt, _: tuple[Stage, ...]) -> None:
        assert attempt.captured is not None
        anchor = attempt.captured.controller
        manifest = Manifest(
            schema=SCHEMA,
            checkpoint_id=attempt.checkpoint_id,
            seq=attempt.seq,
            run=self.host.run,
            created_at=time.time(),
            trainer=TrainerMark(step=anchor.train_steps, policy_version=anchor.policy_version),
            config_fingerprint=self.config_fingerprint,
            topology_fingerprint=fingerprint(expected_topology(self.config)),
            replicas=replica_counts(self.config),
            episodes=sorted(attempt.episodes),
            restarts=sorted(attempt.restarts),
            files=attempt.files,
            trace_id=trace_id_hex(checkpoint_trace_id(attempt.checkpoint_id)),
        )
        publication = await asyncio.to_thread(publish, self.run, attempt.tmp, manifest, self.host.faults)
        attempt.bytes = publication.bytes
        attempt.bytes_written = publication.bytes - sum(f.size for f in attempt.files if f.linked)
        self.base = publication.path.name
        self.host.history.record(
            SnapshotPublished(
                checkpoint_id=attempt.checkpoint_id,
                snapshot=publication.path.name,
                episodes=tuple(sorted(attempt.episodes)),
            )
        )
        self.last_progress = attempt.progress
        await asyncio.to_thread(prune, self.run, self.config.keep_latest_k)
        await asyncio.to_thread(trim_heap)  # the ledger's encoding freed: pages back (memory.trim_heap)
        attempt.published = Published(
            checkpoint_id=attempt.checkpoint_id,
            seq=attempt.seq,
            path=publication.path,
            episodes=len(attempt.episodes),
            bytes=publication.bytes,
            created_at=manifest.created_at,
        )
        if self.on_published is not None:
            self.on_published(attempt.published)


def record_files(attempt: SaveAttempt, address: str, files: tuple[FileDigest, ...], cid: str) -> None:
    """The files a participant wrote, as manifest entries relative to the snapshot directory."""
    prefix = participant_dir(*parse_address(address))
    for f in files:
        attempt.files.append(
            ManifestFile(
                path=str(prefix / f.path),
                sha256=f.sha256,
                size=f.size,
                linked=f.linked,
                records=f.records,
                checkpoint_id=cid,
            )
        )


SaveStepImplementation = Callable[[SaveSequence, SaveAttempt, tuple[Stage, ...]], Awaitable[None]]

SAVE_STEPS: dict[SaveStep, SaveStepImplementation] = {
    SaveStep.RETIRE: SaveSequence.retire,
    SaveStep.ACK_DRAIN: SaveSequence.ack_drain,
    SaveStep.INSTANT: cut.instant,
    SaveStep.PREPARE: cut.prepare,
    SaveStep.PREPARED: cut.prepared,
    SaveStep.DRAIN_RECEIPTS: cut.drain_receipts,
    SaveStep.CAPTURE: cut.capture,
    SaveStep.COMMIT: SaveSequence.commit,
    SaveStep.RESUME: SaveSequence.resume,
    SaveStep.PERSIST: SaveSequence.persist,
    SaveStep.VALIDATE: SaveSequence.validate,
    SaveStep.PUBLISH: SaveSequence.publish,
}
check_step_table(SAVE_SEQUENCE, SAVE_STEPS)
