"""Durable file work: digests, fsync of files and directories, writes that survive a crash."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from parkway.actors.runtime.durable import write_durably


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never a part: written beside it, fsynced, then
    renamed over it (the caller fsyncs the directory once for all its files)."""
    tmp = path.with_suffix(".tmp")
    write_durably(tmp, data)
    os.replace(tmp, path)


def files_on_disk(directory: Path) -> dict[str, int]:
    """Every regular file under ``directory``: its path relative to it, and its size (a symlink is
    none: ``storage.checks`` reports it)."""
    found: dict[str, int] = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = Path(parent) / name
            if not path.is_symlink() and path.is_file():
                found[path.relative_to(directory).as_posix()] = path.stat().st_size
    return found
