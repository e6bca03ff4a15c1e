"""Durable file work: digests, fsync of files and directories, writes that survive a crash."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path


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


def write_durably(path: Path, data: bytes, *, halfway: Callable[[], None] | None = None) -> int:
    """Write ``data`` to ``path`` and fsync it; the bytes written. ``halfway`` runs with half of the
    data flushed: where a fault point fails the write as a full disk would, leaving a torn file."""
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])
        handle.flush()
        if halfway is not None:
            halfway()
        handle.write(data[len(data) // 2 :])
        handle.flush()
        os.fsync(handle.fileno())
        return handle.tell()


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
