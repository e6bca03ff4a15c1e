"""The controller's snapshots of one run: when to take one, what a failed one costs, the restore at
start, and the trainer checkpoints that anchor them.

The save is ``save.py`` and the restore ``restore.py``; both reach the controller only through
``host.SnapshotHost``. Files go through ``actors/storage`` (layout: ``protocol/layout.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from parkway.actors.roles.controller.errors import SnapshotsEnded
from parkway.actors.roles.controller.fingerprints import config_fingerprint
from parkway.actors.roles.controller.host import SnapshotHost
from parkway.actors.roles.controller.metrics import SnapshotMetrics
from parkway.actors.roles.controller.participants import Participants
from parkway.actors.roles.controller.restore import RestoreSequence
from parkway.actors.roles.controller.save import Published, SaveOutcome, SaveSequence
from parkway.actors.run.config import RunConfig
from parkway.actors.storage.runs import RunDirectory
from parkway.actors.storage.trainer import write_trainer_checkpoint
from parkway.protocol.anchor import ControllerAnchor
from parkway.protocol.snapshot import SnapshotFailure

# Kept importable from here, where the CLI has always found them.


class SnapshotCoordinator:
    """Takes snapshots for one controller and restores the newest one at start."""

    def __init__(self, host: SnapshotHost, config: RunConfig, root: Path) -> None:
        self.host = host
        self.config = config
        self.run = RunDirectory(root / host.run)
        self.metrics = SnapshotMetrics()
        self.config_fingerprint = config_fingerprint(config)
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

    async def restore_if_any(self) -> bool:
        """Restore the newest valid snapshot of this run, if there is one. True when restored."""
        return await self.restorer.restore_if_any()

    def check_failure(self, failure: SnapshotFailure) -> None:
        """After a failed (and aborted) attempt: a transient failure is retried at the next interval,
        up to ``max_consecutive_failures`` in a row; an invariant violation ends the run at once,
        naming what broke (raises SnapshotsEnded)."""
        if not failure.transient:
            raise SnapshotsEnded(
                f"snapshot invariant violated at {failure.step}: {failure.detail}"
            ) from failure
        if self.metrics.consecutive_failures >= self.config.max_consecutive_failures:
            raise SnapshotsEnded(
                f"{self.metrics.consecutive_failures} snapshots failed in a row; last at "
                f"{failure.step}: {failure.detail}"
            ) from failure

    # -- trainer checkpoints -----------------------------------------------------------------------
    def write_trainer_checkpoint(self, step: int, *, anchor: ControllerAnchor, state: dict[str, Any]) -> None:
        """The fallback marker (what the trainer consumed so far) and the trainer's state, both durable,
        before the snapshot attempt anchored at this step. Raises OSError (the caller retries)."""
        self.host.faults.reach("trainer_checkpoint_write", path=self.run.trainer_dir)
        write_trainer_checkpoint(self.run, step, anchor=anchor, state=state)

    def mark_completed(self) -> None:
        """A finished run leaves a marker: starting the same run again starts it afresh."""
        self.run.mark_completed()
