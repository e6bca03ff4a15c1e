"""What a snapshot's participants wrote, checked before it is published: every file against its digest
(a pack linked unchanged from the snapshot before is not hashed again), every staging row an agent's
turns name present in TQ's capture."""

from __future__ import annotations

import os
from pathlib import Path

from parkway.actors.storage.checks import missing_staging_keys
from parkway.actors.storage.files import sha256_file
from parkway.protocol.manifest import ManifestFile


def check_files(tmp: Path, files: list[ManifestFile], base: Path | None = None) -> tuple[str, bool] | None:
    """Every file on disk with its digest, and every staging row an agent saved in TQ's rows: None, or
    (what is wrong, whether a later snapshot may do better). Reads files: a worker thread's job. A
    pack linked from ``base`` (the snapshot before, checked when it was saved) that is still the very
    file there is not hashed again: only its size is checked."""
    for entry in files:
        path = tmp / entry.path
        if entry.linked and base is not None and _same_file(path, base / entry.path, entry.size):
            continue
        if not path.is_file() or sha256_file(path) != entry.sha256:
            return f"{entry.path} is missing or does not match its digest", True
    # Every turn an agent saved references a staging row that TQ captured.
    missing = [key for keys in missing_staging_keys(tmp, strict=False).values() for key in keys]
    if missing:
        return f"staging rows not in TQ's capture: {', '.join(missing[:20])}", False
    return None


def _same_file(path: Path, other: Path, size: int) -> bool:
    """``path`` is ``other`` (one inode: a hard link) and has its listed size."""
    try:
        return os.path.samefile(path, other) and path.stat().st_size == size
    except OSError:
        return False
