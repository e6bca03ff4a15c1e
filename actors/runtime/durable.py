"""A file written so that it survives a crash: the one primitive every snapshot write goes through."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


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
