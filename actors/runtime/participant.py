"""A checkpoint participant: the phase machine of ``protocol.phases`` wired to commands and hooks.

Roles that take part in snapshots (agent, resources, policy, tq) subclass ``Participant`` and fill
the hooks; the command handling, fencing, reply caching and the lease are the same for all of them:

- ``close_admission``   at Prepare: stop taking new work (queued work waits, accepted work goes on);
- ``parked_now``        at Prepare: the report at once, when nothing need be waited for (no await);
- ``wait_until_parked`` at Prepare, otherwise: return when the cut can be taken (event driven);
- ``take_cut``          at Commit: an immutable in-memory copy of what the snapshot keeps, and how to
                        write it; no I/O, no await (it is inside the admission-closed window);
- ``install_snapshot``  at Restore: load records, return the attempts restored;
- ``release``           at Resume, Abort and lease lapse: reopen admission and release held replies.

The cut is written at ``Persist``, which the controller sends after admission reopened: the encoding,
writing and fsyncs run in a worker thread, outside the pause (``protocol/cuts.py`` is the cut's life).

A participant whose lease lapses (no Renew, no Resume) resumes itself after the grace period, so one
lost Resume holds it seconds, not minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import structlog
from parkway.actors.runtime import collection
from parkway.actors.runtime.actor import Actor
from parkway.actors.runtime.forgetting import AttemptKey, Fence, forget_fence_size
from parkway.actors.runtime.memory import trim_heap
from parkway.actors.runtime.packs import RecordWriter
from parkway.actors.runtime.snapshot_dirs import check_sources, inside
from parkway.protocol.cut_changes import LastCut
from parkway.protocol.cuts import CutTable
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import AttemptsFenced, PhaseChanged
from parkway.protocol.layout import participant_parts
from parkway.protocol.messages import (
    CONTROL_COMMANDS,
    Abort,
    AttemptRef,
    Capabilities,
    Commit,
    Committed,
    Completed,
    Discover,
    EpisodeRef,
    FileDigest,
    Forget,
    Message,
    Ok,
    Persist,
    Persisted,
    Prepare,
    Prepared,
    Renew,
    Restore,
    Restored,
    Resume,
    Retire,
)
from parkway.protocol.phases import (
    DEFAULT_LEASE_GRACE_S,
    Event,
    Outcome,
    ParticipantPhases,
    Phase,
    Transition,
)

log = structlog.get_logger("parkway.participant")

REPLY_MARGIN_S = 0.25
ENDED_KEPT = 64  # checkpoints whose end a participant remembers (and whose Resume/Abort it replays)
CONTROL_TYPES = frozenset(command.__name__ for command in CONTROL_COMMANDS)


@dataclass(frozen=True, slots=True)
class ParkReport:
    parked: int = 0
    boundaries_passed: int = 0
    restarts: tuple[AttemptRef, ...] = ()
    waited_s: float = 0.0  # time spent waiting for rollouts to reach a boundary
    episodes: tuple[EpisodeRef, ...] = ()  # an agent's cut, taken where its rollouts parked
    receipts: tuple[Completed, ...] = ()  # an agent's receipts not yet acknowledged (they come with it)


@dataclass(frozen=True, slots=True)
class Cut:
    """What a Commit took. ``write`` runs in a worker thread after the window, so it may encode and
    fsync at leisure, but it reads only what the cut holds: immutable values, or copies made at the
    cut, never a structure the event loop goes on changing."""

    write: Callable[[Path], tuple[FileDigest, ...]]
    episodes: tuple[EpisodeRef, ...] = ()


def _write_then_trim(cut: Cut, directory: Path) -> tuple[FileDigest, ...]:
    """Write a cut, then give the heap's free pages back (``memory.trim_heap``): the encoding just
    freed is the largest churn a participant has, and this thread is off the window already."""
    files = cut.write(directory)
    trim_heap()
    return files


# What installing a snapshot a participant cannot read raises (missing, truncated, not its records).
UNREADABLE = (OSError, msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError, ValueError)


class Participant(Actor):
    mode: str = "exported"  # exported | stateless | restart_only
    idempotent: ClassVar[tuple[type[Message], ...]] = (Forget,)  # forgetting twice forgets the same
    # A role whose saved records are per rollout (agents, tool servers) can restore another replica's
    # (``Restore.sources``): the cluster may come back with another number of them.
    takes_over_replicas: ClassVar[bool] = False

    def __init__(
        self,
        *args: Any,
        snapshot_root: Path | None = None,
        lease_grace_s: float = DEFAULT_LEASE_GRACE_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.phases = ParticipantPhases(lease_grace_s=lease_grace_s, max_lease_s=self.max_deadline_s)
        self.snapshot_root = snapshot_root
        fence = forget_fence_size()
        self.retired = Fence(fence)  # attempts given up on (Retire) until forgotten; bounded all the same
        # Attempts the controller forgot (sealed and acknowledged, docs/memory.md): only their ids, the
        # newest ``PARKWAY_FORGET_FENCE``, so a very late duplicate is refused rather than run again.
        self.forgotten = Fence(fence)
        self._forget_pending: dict[AttemptKey, None] = {}  # Forgets received while a checkpoint was open
        self.epoch = 0  # the newest timeline a Restore named: data messages of older ones are refused
        self._ended: dict[str, asyncio.Event] = {}
        self._lease_changed = asyncio.Event()
        self._release_pending: set[str] = set()  # resumed ids whose release waits for the reply
        self._lease_task: asyncio.Task[None] | None = None
        self._phase_since = time.monotonic()  # when the current phase began, for parkway_phase_seconds
        self.cuts: CutTable[Cut] = CutTable()  # taken at Commit, written at Persist
        self.records = RecordWriter(self.faults, self.role)  # the cut's files, written at Persist
        self._prepared: dict[str, Prepared] = {}  # the answer of the checkpoint that is prepared here
        self._last_cut = LastCut()  # what the next Prepare's answer may be made against
        self.metrics.timed_phases()
        self.handlers.update(
            {
                Prepare: self.on_prepare,
                Renew: self.on_renew,
                Commit: self.on_commit,
                Persist: self.on_persist,
                Resume: self.on_resume,
                Abort: self.on_abort,
                Restore: self.on_restore,
                Retire: self.on_retire,
                Forget: self.on_forget,
            }
        )

    # -- hooks (defaults: nothing in flight, nothing to save) ---------------------------------
    async def close_admission(self) -> None:
        """Stop admitting new work for the checkpoint."""

    async def wait_until_parked(self, command: Prepare) -> ParkReport:
        return ParkReport()

    def parked_now(self, command: Prepare) -> ParkReport | None:
        """The cut at once, when nothing need be waited for; None sends the Prepare to
        ``wait_until_parked``. Answered in the step of the event loop the Prepare came in: a Commit
        sent right behind it on the same lane finds it prepared, and a busy loop gets no turn between
        the Prepare and its reply (the wait's tasks cost two)."""
        return None

    def take_cut(self, command: Commit) -> Cut:
        """The cut: copies of what the snapshot keeps, taken now, written later (``Cut.write``). It runs
        inside the window, in one step of the event loop: no I/O, no await. The default keeps only this
        participant's own record."""
        record = {
            "role": self.role,
            "replica": self.replica,
            "checkpoint_id": command.checkpoint_id,
            "episodes": [msgspec.to_builtins(e) for e in command.episodes],
        }
        return Cut(write=lambda directory: (self.records.plain(directory / "participant.msgpack", [record]),))

    async def write_snapshot(self, directory: Path, command: Commit) -> tuple[FileDigest, ...]:
        """Take the cut and write it at once (tools and tests that want a participant's files now)."""
        return self.take_cut(command).write(directory)

    async def install_snapshot(self, directory: Path, command: Restore) -> tuple[AttemptRef, ...]:
        return ()

    async def release(self) -> None:
        """Reopen admission and release held replies."""

    def forget_attempts(self, keys: list[AttemptKey]) -> None:
        """Drop everything held for these attempts (sealed and acknowledged, or given up on): sessions,
        records, receipts. Called outside any checkpoint, after the fences moved (``on_forget``)."""

    def structure_sizes(self) -> dict[str, int]:
        """Entries of each per-rollout structure (docs/memory.md): the participant's fences here."""
        return {
            **super().structure_sizes(),
            "retired": len(self.retired),
            "forgotten": len(self.forgotten),
            "forget_pending": len(self._forget_pending),
            "checkpoints_ended": len(self._ended),
            "cuts_held": self.cuts.holding(),
        }

    # -- status --------------------------------------------------------------------------------
    def timeline(self) -> int:
        return self.epoch

    def in_window(self) -> bool:
        return self.phases.phase is not Phase.IDLE

    def phase_name(self) -> str:
        return self.phases.phase.value

    def status_extras(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.phases.checkpoint_id,
            "lease_expires_at": self.phases.lease_expires_at,
            "epoch": self.epoch,
        }

    async def on_discover(self, _: Discover) -> Message:
        return Capabilities(
            role=self.role, replica=self.replica, mode=self.mode, restart_only=self.mode == "restart_only"
        )

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await super().start()
        self._lease_task = asyncio.get_running_loop().create_task(self._watch_lease())

    async def stop(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease_task
        await super().stop()

    # -- command handlers ----------------------------------------------------------------------
    async def on_prepare(self, command: Prepare) -> Message:
        self.faults.reach("participant_prepare", self.role)  # crash tests: die in the middle of a prepare
        cid = command.checkpoint_id
        retry = self.phases.checkpoint_id == cid and self.phases.phase in (Phase.PREPARING, Phase.PREPARED)
        if not retry:
            self._apply(Event.PREPARE, cid, command.deadline)
            self._ended[cid] = asyncio.Event()
            self._prepared.clear()
            await self.close_admission()
        if self.phases.phase is Phase.PREPARED:
            return self._prepared.get(cid, Prepared(checkpoint_id=cid))
        report = self.parked_now(command)
        if report is None:
            report = await wait_parked(self, command, self._ended.setdefault(cid, asyncio.Event()))
        self._apply(Event.PARKED, cid, None)
        log.info("prepared", parked=report.parked, restarts=len(report.restarts))
        prepared = Prepared(
            checkpoint_id=cid,
            parked=report.parked,
            boundaries_passed=report.boundaries_passed,
            restarts=report.restarts,
            waited_s=report.waited_s,
            episodes=report.episodes,
            receipts=report.receipts,
        )
        prepared = self._last_cut.answer(command.base, prepared)  # an agent's: what changed in its cut
        self._prepared[cid] = prepared  # a Prepare sent again gets the same cut
        return prepared

    async def on_renew(self, command: Renew) -> Message:
        self._apply(Event.RENEW, command.checkpoint_id, command.deadline)
        return Ok(detail=f"lease until {self.phases.lease_expires_at}")

    async def on_commit(self, command: Commit) -> Message:
        # Check first, take the cut, then move: a commit refused for its phase takes nothing.
        self.phases.check(Event.COMMIT, command.checkpoint_id, now=time.time(), deadline=command.deadline)
        self.participant_dir(command.location)  # refused now, not at Persist, if it leads elsewhere
        cut = self.take_cut(command)
        self.cuts.take(command.checkpoint_id, cut)
        self._apply(Event.COMMIT, command.checkpoint_id, command.deadline)
        log.info("committed", episodes=len(cut.episodes or command.episodes))
        return Committed(checkpoint_id=command.checkpoint_id, episodes=cut.episodes or command.episodes)

    async def on_persist(self, command: Persist) -> Message:
        """Write the cut this id's Commit took, in a worker thread: the rollouts run meanwhile."""
        cid = command.checkpoint_id
        directory = self.participant_dir(command.location)
        self.records.base = self.participant_dir(command.base) if command.base else None
        cut = self.cuts.persist(cid)
        try:
            files = await asyncio.to_thread(_write_then_trim, cut, directory)
        except OSError as exc:
            # A write that failed (disk full, I/O error) leaves nothing half-written behind; the
            # controller aborts the snapshot under this id and the previous one stays authoritative.
            if self.cuts.phase(cid) is not None:  # (not aborted while it was written)
                self.cuts.failed(cid)
            shutil.rmtree(directory, ignore_errors=True)
            log.warning("persist_failed", error=str(exc), errno=errno_name(exc))
            raise ProtocolError(ErrorCode.UNAVAILABLE, f"persist of {cid} failed: {exc}") from exc
        if self.cuts.phase(cid) is None:  # aborted while it was written: the files are moot
            shutil.rmtree(directory, ignore_errors=True)
            raise ProtocolError(ErrorCode.STALE_CHECKPOINT, f"{cid} was aborted while its cut was written")
        self.cuts.written(cid)
        log.info("persisted", files=len(files))
        return Persisted(checkpoint_id=cid, files=files)

    async def on_resume(self, command: Resume) -> Message:
        # A resume needs no deadline check: releasing is always safe and always wanted.
        transition = self._apply(Event.RESUME, command.checkpoint_id, None)
        if transition.outcome is Outcome.MOVED:
            # The release itself waits until the reply is written (``after_reply``): releasing first
            # wakes every parked rollout (agents) or held call (policy), and their next steps would run
            # before the reply, holding the controller's admission gate closed while they do.
            await self._end(command.checkpoint_id, release=False)
            self._release_pending.add(command.checkpoint_id)
            return Ok(detail="resumed")
        return Ok(detail=f"{command.checkpoint_id} had already ended")

    async def after_reply(self, message: Message) -> None:
        if isinstance(message, Resume) and message.checkpoint_id in self._release_pending:
            self._release_pending.discard(message.checkpoint_id)
            if self.phases.phase is Phase.IDLE:  # not when the next checkpoint already began preparing
                await self.release()

    async def on_abort(self, command: Abort) -> Message:
        # A cut taken (or being written) for this id is let go: the snapshot will not be published. It
        # may come after the id ended here (resumed): a snapshot that fails once admission reopened.
        dropped = self.cuts.drop(command.checkpoint_id)
        transition = self._apply(Event.ABORT, command.checkpoint_id, None)
        if transition.outcome is Outcome.MOVED:
            log.warning("aborted", reason=command.reason, phase_before=transition.before.value)
            await self._end(command.checkpoint_id)
            return Ok(detail=f"aborted in phase {transition.before.value}")
        if dropped:
            log.warning("aborted", reason=command.reason, phase_before=transition.before.value, cut="dropped")
            return Ok(detail="aborted: its cut dropped")
        if transition.outcome is Outcome.FENCED:
            self._ended.setdefault(command.checkpoint_id, asyncio.Event()).set()
            return Ok(detail="fenced: that id can no longer start here")
        return Ok(detail=f"{command.checkpoint_id} had already ended")

    async def on_restore(self, command: Restore) -> Message:
        self.phases.check(Event.RESTORE, command.checkpoint_id, now=time.time(), deadline=command.deadline)
        # What this process remembers of the timeline that died goes: its fences and its cached replies
        # to data messages (model calls, tool calls, seals) may name attempt numbers the restored
        # ledger gives out again, and a cached reply would answer the new attempt without doing its
        # work (no staging row, no mutation). The controller fences the restored timeline's dead
        # attempts right after; replies to control commands stay (a resent command gets its answer).
        directory = self.participant_dir(command.location)
        run_dir = directory.parents[len(self.snapshot_parts())]  # checked to be inside it, above
        check_sources(
            command,
            role=self.role,
            replica=self.replica,
            takes_over=self.takes_over_replicas,
            run_dir=run_dir,
        )
        try:
            rollouts = await self.install_snapshot(directory, command)
        except UNREADABLE as exc:
            # A snapshot this participant cannot read (missing, truncated, not its records) is refused
            # with what is wrong; installing reads everything before it changes anything.
            detail = (
                exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            )
            where = directory.relative_to(self.snapshot_root) if self.snapshot_root else directory
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE, f"{command.location} cannot be restored: {where}: {detail}"
            ) from exc
        # The forgotten ids go too: the restored ledger may dispatch them again (rollouts sealed after
        # the snapshot run anew), and a late message of the dead timeline is refused by its epoch.
        self.retired.clear()
        self.forgotten.clear()
        self._forget_pending.clear()
        self.epoch = max(self.epoch, command.epoch)
        self.replies.evict_all(keep=CONTROL_TYPES)
        self._apply(Event.RESTORE, command.checkpoint_id, command.deadline)
        self._ended[command.checkpoint_id] = asyncio.Event()
        return Restored(checkpoint_id=command.checkpoint_id, rollouts=rollouts)

    async def on_retire(self, command: Retire) -> Message:
        for ref in command.attempts:
            self.retired.add((ref.rollout_id, ref.attempt))
        if self.history.enabled:
            fenced = tuple((r.rollout_id, r.attempt) for r in command.attempts)
            self.history.record(AttemptsFenced(checkpoint_id=command.checkpoint_id, attempts=fenced))
        return Ok(detail=f"retired {len(command.attempts)}")

    async def on_forget(self, command: Forget) -> Message:
        """Forget is idempotent and answered at once; while a checkpoint is open (Prepare to its
        Resume or Abort) it waits for the end, so capture and validation see a stable state."""
        keys = [(ref.rollout_id, ref.attempt) for ref in command.attempts]
        if self.phases.phase is not Phase.IDLE:
            self._forget_pending.update(dict.fromkeys(keys))
            self.counts["forget_deferred"] += len(keys)
            return Ok(detail=f"forgetting {len(keys)} when {self.phases.checkpoint_id} ends")
        self._forget(keys)
        return Ok(detail=f"forgot {len(keys)}")

    def _forget(self, keys: list[AttemptKey]) -> None:
        for key in keys:
            self.retired.discard(key)
        self.forgotten.update(keys)
        # Their cached replies go too (a late duplicate then meets the fence above, not a replay).
        self.replies.evict_rollouts(AttemptRef(rollout_id=r, attempt=a) for r, a in keys)
        self.forget_attempts(keys)
        self.counts["attempts_forgotten"] += len(keys)

    def _forget_deferred(self) -> None:
        if self._forget_pending and self.phases.phase is Phase.IDLE:
            keys = list(self._forget_pending)
            self._forget_pending.clear()
            self._forget(keys)

    def is_forgotten(self, rollout_id: str, attempt: int) -> bool:
        return (rollout_id, attempt) in self.forgotten

    def refuse_forgotten(self, rollout_id: str, attempt: int) -> None:
        """A late duplicate of a forgotten attempt: ``stale_attempt``, never a new run of it."""
        if (rollout_id, attempt) in self.forgotten:
            self.counts["forgotten_refused"] += 1
            raise ProtocolError(
                ErrorCode.STALE_ATTEMPT,
                f"{rollout_id} attempt {attempt} is finished and forgotten here: a late duplicate",
            )

    # -- helpers -------------------------------------------------------------------------------
    def snapshot_parts(self) -> tuple[str, ...]:
        """Where this participant's records go inside a snapshot directory."""
        return participant_parts(self.role, self.replica)

    def source_dirs(self, directory: Path, command: Restore) -> list[Path]:
        """What a restore reads: ``directory`` (its own) when ``command.sources`` is None, else the
        named replicas' directories, whose rollouts this one takes over (none when it is empty)."""
        sources = command.sources
        return (
            [directory] if sources is None else [self.participant_dir(command.location, r) for r in sources]
        )

    def participant_dir(self, location: str, replica: int | None = None) -> Path:
        """This participant's directory in snapshot ``location`` (or that of ``replica`` of its
        role), checked to stay inside the run's snapshot directory (``snapshot_dirs.inside``)."""
        parts = self.snapshot_parts() if replica is None else participant_parts(self.role, replica)
        return inside(self.snapshot_root, self.run, location, parts, self.address)

    def _apply(self, event: Event, checkpoint_id: str, deadline: float | None) -> Transition:
        transition = self.phases.apply(event, checkpoint_id, now=time.time(), deadline=deadline)
        self._lease_changed.set()
        if transition.outcome is Outcome.MOVED:
            self._time_phase(transition)
            log.info("phase", on=event.value, before=transition.before.value, after=transition.after.value)
            self.history.record(
                PhaseChanged(checkpoint_id=checkpoint_id, event=event.value, after=transition.after.value)
            )
        return transition

    def _time_phase(self, transition: Transition) -> None:
        """Observe how long the phase just left lasted (a Renew stays in its phase: not a new one)."""
        if transition.after is transition.before:
            return
        now = time.monotonic()
        self.metrics.phase_left(transition.before.value, now - self._phase_since)
        self._phase_since = now

    async def _end(self, checkpoint_id: str, *, release: bool = True) -> None:
        self._ended.setdefault(checkpoint_id, asyncio.Event()).set()
        # An ended id answers Prepare/Commit/Restore with stale_checkpoint from now on, not with the
        # reply it got while alive; re-sent Resume and Abort keep their cached answers.
        self.replies.evict(checkpoint_id, keep=frozenset({"Resume", "Abort"}))
        if release:
            await self.release()
        self._forget_deferred()  # what the controller forgot while the checkpoint was open
        collection.window_ended()  # a full collection that is due runs now, as far from the next as can be
        # Keep the end events of recent ids only; the phase machine's fence is the lasting record. A
        # re-sent Resume or Abort that old is answered stale (nobody waits for it any more), so its
        # cached reply goes with the id; a journaled reply (Persist) stays to the journal's bounds.
        while len(self._ended) > ENDED_KEPT:
            old = next(iter(self._ended))
            self._ended.pop(old)
            self.replies.evict(old, journaled=False)

    async def _watch_lease(self) -> None:
        while True:
            self._lease_changed.clear()
            expires = self.phases.lease_expires_at
            if expires is None:
                await self._lease_changed.wait()
                continue
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the cancellation that
                # stop() sends when the lease changed in the same instant, and stop() then hangs.
                async with asyncio.timeout(max(0.0, expires - time.time())):
                    await self._lease_changed.wait()
            except TimeoutError:
                with structlog.contextvars.bound_contextvars(
                    **self.log_context(), checkpoint_id=self.phases.checkpoint_id
                ):
                    transition = self.phases.lapse_if_expired(time.time())
                    if transition is not None:
                        self._time_phase(transition)
                        log.warning("lease_lapsed", phase_before=transition.before.value)
                        self.history.record(
                            PhaseChanged(checkpoint_id=transition.checkpoint_id, event="lapse", after="idle")
                        )
                        await self._end(transition.checkpoint_id)


async def wait_parked(participant: Participant, command: Prepare, ended: asyncio.Event) -> ParkReport:
    """``wait_until_parked``, bounded by the command's deadline and by the id's end (an Abort)."""
    cid = command.checkpoint_id
    parked = asyncio.ensure_future(participant.wait_until_parked(command))
    end_wait = asyncio.ensure_future(ended.wait())
    try:
        # Answer a little before the deadline, so "not parked yet" reaches the controller in time.
        remaining = command.deadline - time.time()
        timeout = max(0.0, remaining - min(REPLY_MARGIN_S, 0.1 * remaining))
        done, _ = await asyncio.wait({parked, end_wait}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        end_wait.cancel()
    if parked not in done:
        parked.cancel()
        if end_wait in done or ended.is_set():
            raise ProtocolError(ErrorCode.STALE_CHECKPOINT, f"{cid} ended while preparing")
        raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, f"not parked before the deadline of {cid}")
    return parked.result()


def errno_name(exc: OSError) -> str | None:
    return errno.errorcode.get(exc.errno) if exc.errno is not None else None
