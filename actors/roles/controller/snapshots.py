"""The controller's snapshots of one run: when to take one, what a failed one costs, the restore at
start, and the trainer checkpoints that anchor them.

The save is ``save.py`` and the restore ``restore.py``; both reach the controller only through
``host.SnapshotHost``. Files go through ``actors/storage`` (layout: ``protocol/layout.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from parkway.actors.roles.controller.errors import SnapshotsEnded
from parkway.actors.roles.controller.fingerprints import config_fingerprint
from parkway.actors.roles.controller.host import SnapshotHost
from parkway.actors.roles.controller.metrics import SnapshotMetrics
from parkway.actors.roles.controller.participants import Participants
from parkway.actors.roles.controller.restore import RestoreSequence
from parkway.actors.roles.controller.save import Published, SaveOutcome, SaveSequence, Skipped
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime.backoff import retrying
from parkway.actors.runtime.settings import cluster_wait_s
from parkway.actors.storage.runs import RunDirectory
from parkway.actors.storage.trainer import write_trainer_checkpoint
from parkway.protocol.anchor import ControllerAnchor
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import Message, Snapshot, SnapshotTaken
from parkway.protocol.snapshot import SnapshotFailure
from parkway.protocol.snapshot_failures import FailurePolicy, SnapshotHealth

log = structlog.get_logger("parkway.snapshots")
ABORT_AT_EXIT_S = 10.0  # how long a run ending on an error waits to abort a save it cut off

RESTORE_RETRY_FIRST_S, RESTORE_RETRY_MAX_S = 0.5, 8.0  # the pause before retrying a failed restore


class SnapshotCoordinator:
    """Takes snapshots for one controller and restores the newest one at start."""

    def __init__(self, host: SnapshotHost, config: RunConfig, root: Path) -> None:
        self.host = host
        self.config = config
        self.run = RunDirectory(root / host.run)
        self.metrics = SnapshotMetrics()
        self.failure_policy = FailurePolicy(
            interval_s=config.snapshot_interval_s,
            backoff_max_s=config.snapshots.backoff_max_s,
            end_after_failures=config.snapshots.end_after_failures,
            end_after_failing_s=config.snapshots.end_after_failing_s,
        )
        self.config_fingerprint = config_fingerprint(config)
        self._register_gauges()
        participants = Participants(host, config)
        self.saver = SaveSequence(host, config, self.run, participants, self.metrics, self.config_fingerprint)
        self.restorer = RestoreSequence(
            host, config, self.run, participants, self.metrics, self.saver, self.config_fingerprint
        )

    @property
    def on_published(self) -> Callable[[Published], None] | None:
        """A test hook: called with each snapshot right after it is published, before it resumes."""
        return self.saver.on_published

    @on_published.setter
    def on_published(self, hook: Callable[[Published], None] | None) -> None:
        self.saver.on_published = hook

    async def save(self, *, force: bool = False, checkpoint_id: str | None = None) -> SaveOutcome:
        """One snapshot attempt (see ``SaveSequence.save``). Raises SnapshotFailure."""
        return await self.saver.save(force=force, checkpoint_id=checkpoint_id)

    async def settle_abort(self) -> None:
        """Wait for an abort round still in flight (the run's end: every participant hears it)."""
        await self.saver.settle_abort()

    async def restore_if_any(self) -> bool:
        """Restore the newest valid snapshot of this run, if there is one. True when restored.

        A transient failure (a broker outage, a participant restarting) is retried from the first step
        under a new restore id, backing off, for as long as the cluster wait allows: what a controller
        restarted after the failure would do, without the restart. Each failed try was aborted
        everywhere it could be (``RestoreSequence``); a restore is a sequence of idempotent commands."""
        return await retrying(
            self.restorer.restore_if_any,
            retry_on=SnapshotFailure,
            for_s=cluster_wait_s(),
            first_s=RESTORE_RETRY_FIRST_S,
            max_s=RESTORE_RETRY_MAX_S,
            final=lambda failure: not failure.transient,
            on_retry=lambda failure, pause: log.warning(
                "restore_retried", step=failure.step, detail=failure.detail, retry_in_s=pause
            ),
        )

    def check_failure(self, failure: SnapshotFailure) -> None:
        """After a failed (and aborted) attempt: a transient failure is retried after a back-off while
        the rollouts go on, and ends the run only as ``snapshots.end_after_failures`` or
        ``end_after_failing_s`` say (never, by default); an invariant violation ends the run at once,
        naming what broke (raises SnapshotsEnded)."""
        streak, now = self.metrics.streak, time.time()
        if not failure.transient:
            log.error("snapshots_ended", step=failure.step, detail=failure.detail, transient=False)
            raise SnapshotsEnded(
                f"snapshot invariant violated at {failure.step}: {failure.detail}"
            ) from failure
        ends = streak.ends_run(self.failure_policy, now)
        wait = self.failure_policy.wait_s(streak.consecutive)
        streak.next_attempt_at = None if ends else now + wait
        log.warning(
            "snapshot_failed",
            step=failure.step,
            detail=failure.detail,
            transient=True,
            consecutive=streak.consecutive,
            retry_in_s=None if ends else round(wait, 3),
            newest_snapshot=streak.newest_snapshot,
            rollouts_sealed=self.host.counts["rollouts_sealed"],
        )
        if ends:
            log.error("snapshots_ended", step=failure.step, detail=failure.detail, reason=ends)
            raise SnapshotsEnded(f"{ends}; last at {failure.step}: {failure.detail}") from failure

    def _register_gauges(self) -> None:
        streak = self.metrics.streak  # read in the metrics server's thread: plain attribute reads

        def age() -> float:
            newest = streak.newest_published_at
            return float("nan") if newest is None else time.time() - newest

        metrics = self.host.metrics
        metrics.gauge("parkway_snapshot_age_seconds", "Age of the newest published snapshot", age)
        metrics.gauge(
            "parkway_snapshot_consecutive_failures",
            "Snapshot attempts failed in a row",
            lambda: float(streak.consecutive),
        )
        metrics.gauge(
            "parkway_snapshot_last_failure_timestamp_seconds",
            "When the last snapshot attempt failed (0: never)",
            lambda: streak.last_failure_at or 0.0,
        )

    def next_wait_s(self) -> float:
        """Seconds until the snapshot loop's next attempt: the interval, or the back-off after failures."""
        wait = self.failure_policy.wait_s(self.metrics.streak.consecutive)
        self.metrics.streak.next_attempt_at = time.time() + wait
        return wait

    def health(self) -> SnapshotHealth:
        return self.metrics.streak.health()

    # -- trainer checkpoints -----------------------------------------------------------------------
    def write_trainer_checkpoint(self, step: int, *, anchor: ControllerAnchor, state: dict[str, Any]) -> None:
        """The fallback marker (what the trainer consumed so far) and the trainer's state, both durable,
        before the snapshot attempt anchored at this step. Raises OSError (the caller retries)."""
        self.host.faults.reach("trainer_checkpoint_write", path=self.run.trainer_dir)
        write_trainer_checkpoint(self.run, step, anchor=anchor, state=state)

    async def mark_completed(self) -> None:
        """A finished run leaves a marker: starting the same run again starts it afresh. Storage that
        fails (a full or unwritable state directory) is waited for, backing off, as long as a snapshot
        streak may last (``snapshots.backoff_max_s``): the run's work is done and sealed, only its
        marker is missing. After that the error ends the run (exit 3); a start then restores the newest
        snapshot and finds nothing left to do."""

        async def mark() -> None:
            self.run.mark_completed()

        try:
            await retrying(
                mark,
                retry_on=OSError,
                for_s=self.config.snapshots.backoff_max_s,
                first_s=RESTORE_RETRY_FIRST_S,
                max_s=RESTORE_RETRY_MAX_S,
                on_retry=lambda exc, pause: log.warning(
                    "completed_marker_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=pause
                ),
            )
        except OSError as exc:
            raise SnapshotsEnded(f"the run completed but its marker cannot be written: {exc}") from exc


async def take_requested(
    snapshots: SnapshotCoordinator | None, lock: asyncio.Lock, request: Snapshot
) -> Message:
    """``parkway snapshot`` (``Controller.on_snapshot``): one snapshot now, answered with what was
    published; ``snapshots`` is None when no workload with snapshots runs."""
    if snapshots is None:
        raise ProtocolError(ErrorCode.UNAVAILABLE, "no workload with snapshots is running on this controller")
    try:
        async with lock:
            # Asked for by name: taken even if nothing moved, under the request's own id, so a
            # `parkway logs --checkpoint-id ID --follow` started first sees every line of it.
            outcome = await snapshots.save(force=True, checkpoint_id=request.checkpoint_id)
    except SnapshotFailure as failure:
        raise ProtocolError(
            ErrorCode.UNAVAILABLE, f"snapshot failed at {failure.step}: {failure.detail}"
        ) from None
    if isinstance(outcome, Skipped):
        return SnapshotTaken(snapshot="", skipped=True)
    return SnapshotTaken(snapshot=outcome.name, checkpoint_id=outcome.checkpoint_id)


async def stop_between_saves(snapshot_loop: asyncio.Task[None], lock: asyncio.Lock) -> None:
    """The run's end: the snapshot loop stops between two saves, never inside one. A save cut off
    mid-way would leave every participant prepared for its id until the lease lapses, and the next
    session's first Prepare refused there (``checkpoint_conflict``)."""
    async with lock:  # a save in flight ends (published, skipped or aborted) first
        snapshot_loop.cancel()
        await asyncio.gather(snapshot_loop, return_exceptions=True)


async def settle_cut_off_abort(snapshots: SnapshotCoordinator | None) -> None:
    """A save an error cut off started its abort round: wait for it, bounded, so no participant stays
    held; the error that ended the run is what the caller raises, not this round's."""
    if snapshots is not None:  # (no round in flight: settle_abort returns at once)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(snapshots.settle_abort(), ABORT_AT_EXIT_S)
