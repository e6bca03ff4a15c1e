"""What is on disk under a snapshot root: the snapshots of a run, and what a restore would do.

Read-only: nothing here writes, renames or deletes. The controller's save writes the layout
(``protocol/layout.py``) through ``storage.publish``; every problem of one snapshot is found by
``storage.checks``; ``parkway snapshots list|show|verify`` prints what this module finds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from parkway.actors.storage.checks import Problem, check_snapshot, read_manifest
from parkway.actors.storage.files import files_on_disk
from parkway.actors.storage.runs import RunDirectory, list_snapshots, trainer_steps
from parkway.actors.storage.select import may_be_this_work, skip_reason
from parkway.protocol.layout import MANIFEST
from parkway.protocol.manifest import Manifest, parse_manifest

# -- a run -------------------------------------------------------------------------------------------


@dataclass
class SnapshotInfo:
    """One snapshot directory as a listing shows it."""

    name: str
    path: Path
    seq: int
    size_bytes: int
    files: int
    created_at: float  # the manifest's creation time; the directory's mtime when it has none
    manifest: Manifest | None  # None when the manifest cannot be read or does not fit its schema
    # The manifest's JSON object as read, whatever its shape: what a listing can still show of a
    # manifest that does not fit its schema (and whether it may hold this work: ``may_be_this_work``).
    raw: dict[str, Any] | None
    problem: Problem | None  # the first problem a restore would see; None when it verifies
    restore: bool = False  # the one a restore would start from
    skip_reason: str | None = None  # why a restore passes over it (None: taken, or an older one)

    @property
    def checkpoint_id(self) -> str | None:
        return self.manifest.checkpoint_id if self.manifest else _get(self.raw, "checkpoint_id", str)

    @property
    def trainer_step(self) -> int | None:
        if self.manifest:
            return self.manifest.trainer.step
        return _get(_get(self.raw, "trainer", dict), "step", int)

    @property
    def policy_version(self) -> int | None:
        if self.manifest:
            return self.manifest.trainer.policy_version
        return _get(_get(self.raw, "trainer", dict), "policy_version", int)

    @property
    def rollouts_saved(self) -> int | None:
        episodes = self.manifest.episodes if self.manifest else _get(self.raw, "episodes", list)
        return len(episodes) if episodes is not None else None

    @property
    def restarts(self) -> int | None:
        restarts = self.manifest.restarts if self.manifest else _get(self.raw, "restarts", list)
        return len(restarts) if restarts is not None else None

    @property
    def config_fingerprint(self) -> str | None:
        if self.manifest:
            return self.manifest.config_fingerprint
        return _get(self.raw, "config_fingerprint", str)

    def field(self, key: str) -> Any:
        """A top-level manifest field as JSON, from whatever manifest could be read (None if absent)."""
        if self.manifest:
            return msgspec.to_builtins(getattr(self.manifest, key, None))
        return self.raw.get(key) if self.raw else None

    def listed_files(self) -> list[dict[str, Any]]:
        """The manifest's file entries as JSON objects (of a broken manifest: those with a path)."""
        if self.manifest:
            return [msgspec.to_builtins(entry) for entry in self.manifest.files]
        entries = self.raw.get("files") if self.raw else None
        if not isinstance(entries, list):
            return []
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("path"), str)]

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "seq": self.seq,
            "checkpoint_id": self.checkpoint_id,
            "trainer_step": self.trainer_step,
            "policy_version": self.policy_version,
            "rollouts_saved": self.rollouts_saved,
            "restarts": self.restarts,
            "size_bytes": self.size_bytes,
            "files": self.files,
            "created_at": self.created_at,
            "age_s": round(now - self.created_at, 3),
            "config_fingerprint": self.config_fingerprint,
            "verifies": self.problem is None,
            "problem": self.problem.to_json() if self.problem else None,
            "restore": self.restore,
            "skip_reason": self.skip_reason,
        }


def _get(obj: Any, key: str, kind: type) -> Any:
    value = obj.get(key) if isinstance(obj, dict) else None
    if kind is int and isinstance(value, bool):
        return None
    return value if isinstance(value, kind) else None


@dataclass
class RunInventory:
    """The snapshots of one run directory, and what a restore of that run would do with them."""

    run_dir: Path
    snapshots: list[SnapshotInfo]
    completed_at: float | None  # the COMPLETED marker's time, when the run finished
    trainer_steps: list[int]
    temporary: list[str]  # tmp_* directories: a snapshot that never published (or one being written)
    config_fingerprint: str | None  # the configuration a restore is judged against
    config_source: str  # where that fingerprint came from
    restore_detail: str  # what a start of this run would do, in words
    fallback_step: int | None = None  # the trainer checkpoint a restore falls back to, without a snapshot

    @property
    def run(self) -> str:
        return self.run_dir.name

    @property
    def selected(self) -> SnapshotInfo | None:
        return next((s for s in self.snapshots if s.restore), None)

    def find(self, key: str) -> SnapshotInfo | None:
        """A snapshot by directory name (``snapshot_3``), sequence number (``3``) or checkpoint id."""
        for snapshot in self.snapshots:
            if key in (snapshot.name, str(snapshot.seq), snapshot.checkpoint_id):
                return snapshot
        return None

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "run": self.run,
            "run_dir": str(self.run_dir),
            "completed": self.completed_at is not None,
            "completed_at": self.completed_at,
            "trainer_checkpoints": self.trainer_steps,
            "temporary": self.temporary,
            "config_fingerprint": self.config_fingerprint,
            "config_source": self.config_source,
            "restore": {
                "snapshot": self.selected.name if self.selected else None,
                "fallback_trainer_step": self.fallback_step,
                "detail": self.restore_detail,
            },
            "snapshots": [s.to_json(now) for s in self.snapshots],
        }


def describe(directory: Path, seq: int) -> SnapshotInfo:
    """One snapshot, judged by the check a restore and ``snapshots verify`` make."""
    raw, _ = read_manifest(directory)
    try:
        manifest = parse_manifest(raw) if raw is not None else None
    except msgspec.ValidationError:
        manifest = None
    problems = check_snapshot(directory)
    on_disk = files_on_disk(directory)
    created = (
        manifest.created_at if manifest else _get(raw, "created_at", float) or _get(raw, "created_at", int)
    )
    if created is None:
        stat_of = directory / MANIFEST if (directory / MANIFEST).exists() else directory
        created = stat_of.stat().st_mtime
    return SnapshotInfo(
        name=directory.name,
        path=directory,
        seq=seq,
        size_bytes=sum(on_disk.values()),
        files=len(on_disk),
        created_at=float(created),
        manifest=manifest,
        raw=raw,
        problem=problems[0] if problems else None,
    )


def inventory(
    run_dir: Path, *, config_fingerprint: str | None = None, config_source: str = ""
) -> RunInventory:
    """The snapshots of ``run_dir`` and the one a restore would start from, judged as the controller's
    restore judges them. Without a ``config_fingerprint`` (no configuration given) the newest snapshot
    that verifies stands for the configuration."""
    run = RunDirectory(run_dir)
    snapshots = [describe(path, seq) for seq, path in list_snapshots(run_dir)]
    completed_at = run.completed_at()
    steps = trainer_steps(run_dir)
    trainer_step = steps[-1] if steps else None
    temporary = run.temporary()

    if config_fingerprint is None:
        newest_valid = next((s for s in reversed(snapshots) if s.problem is None), None)
        if newest_valid is not None:
            config_fingerprint = newest_valid.config_fingerprint
            config_source = f"assumed: the configuration of {newest_valid.name}, the newest that verifies"
        else:
            config_source = "none: no snapshot verifies and no configuration was given"

    found = RunInventory(
        run_dir=run_dir,
        snapshots=snapshots,
        completed_at=completed_at,
        trainer_steps=steps,
        temporary=temporary,
        config_fingerprint=config_fingerprint,
        config_source=config_source,
        restore_detail="",
    )
    if completed_at is not None:
        found.restore_detail = (
            "the run is marked completed: its next start begins afresh and deletes these snapshots"
        )
        return found
    for snapshot in reversed(snapshots):
        if snapshot.problem is not None:
            snapshot.skip_reason = f"does not verify: {snapshot.problem.file} {snapshot.problem.detail}"
            continue
        assert snapshot.manifest is not None  # a manifest that does not fit its schema is a problem
        reason = (
            skip_reason(snapshot.manifest, config_fingerprint=config_fingerprint, trainer_step=trainer_step)
            if config_fingerprint is not None
            else "no configuration to judge it by"
        )
        if reason is not None:
            snapshot.skip_reason = reason
            continue
        snapshot.restore = True
        found.restore_detail = f"a restore starts from {snapshot.name}"
        return found
    broken = [
        s.name for s in snapshots if s.problem is not None and may_be_this_work(s.raw, config_fingerprint)
    ]
    if trainer_step is not None:
        found.fallback_step = trainer_step
        found.restore_detail = (
            f"no snapshot fits: a restore falls back to trainer checkpoint {trainer_step}'s marker "
            "(unfinished groups restart from their prompt)"
        )
    elif broken:
        found.restore_detail = (
            f"no snapshot verifies ({', '.join(broken)}): a start refuses to begin afresh over them; "
            "move them away to start afresh"
        )
    else:
        found.restore_detail = "no snapshot fits: a start begins afresh"
    return found
