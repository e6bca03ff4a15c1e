"""Which snapshot a restore starts from: the newest that verifies and belongs to this work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
from parkway.actors.storage.checks import check_snapshot, read_manifest
from parkway.actors.storage.runs import list_snapshots
from parkway.protocol.layout import MANIFEST
from parkway.protocol.manifest import Manifest, ManifestHead, decode_manifest

log = structlog.get_logger("parkway.snapshots")


class SnapshotInvalid(Exception):
    """A snapshot on disk that does not verify; the message says exactly what is wrong."""


class NoValidSnapshot(SnapshotInvalid):
    """Snapshots of this work are on disk and none verifies: a start refuses to begin afresh over them
    (that would silently throw their rollouts away); the message names each one and what is wrong."""


def verify_snapshot(directory: Path) -> Manifest:
    """The manifest of a snapshot that passes ``storage.checks.check_snapshot``, the very check
    ``parkway snapshots verify`` makes. Raises ``SnapshotInvalid`` with the first problem found
    (``check_snapshot`` lists them all)."""
    problems = check_snapshot(directory)
    if problems:
        raise SnapshotInvalid(problems[0].message)
    return decode_manifest((directory / MANIFEST).read_bytes())


def skip_reason(manifest: ManifestHead, *, config_fingerprint: str, trainer_step: int | None) -> str | None:
    """Why a restore passes over a snapshot that verifies; None when it would take it."""
    if manifest.config_fingerprint != config_fingerprint:
        return "written under another configuration"
    if trainer_step is not None and manifest.trainer.step != trainer_step:
        return f"anchored at trainer step {manifest.trainer.step}, not {trainer_step}"
    return None


def may_be_this_work(manifest: Any, config_fingerprint: str | None) -> bool:
    """Whether a snapshot that does not verify could hold this configuration's work: its manifest
    (the JSON object as read, whatever shape it has) cannot say otherwise (unreadable, no fingerprint)
    or names this very configuration. A start never begins afresh over such a snapshot; one of other
    work is no reason to stop."""
    theirs = manifest.get("config_fingerprint") if isinstance(manifest, dict) else None
    return not isinstance(theirs, str) or config_fingerprint is None or theirs == config_fingerprint


def select_snapshot(
    run_dir: Path,
    *,
    config_fingerprint: str,
    trainer_step: int | None = None,
    broken: list[str] | None = None,
) -> tuple[Path, Manifest] | None:
    """The newest snapshot that verifies, belongs to this configuration and (when the trainer has
    checkpoints) is anchored at the newest one; corrupt ones are skipped with a warning naming them
    (the one before stays authoritative). ``broken`` collects what is wrong with each skipped one
    that may hold this configuration's work."""
    for _, path in reversed(list_snapshots(run_dir)):
        try:
            manifest = verify_snapshot(path)
        except SnapshotInvalid as exc:
            log.warning("snapshot_skipped", snapshot=path.name, reason=str(exc))
            if broken is not None and may_be_this_work(read_manifest(path)[0], config_fingerprint):
                broken.append(str(exc))
            continue
        reason = skip_reason(manifest, config_fingerprint=config_fingerprint, trainer_step=trainer_step)
        if reason is not None:
            other_work = manifest.config_fingerprint != config_fingerprint
            (log.warning if other_work else log.info)("snapshot_skipped", snapshot=path.name, reason=reason)
            continue
        return path, manifest
    return None
