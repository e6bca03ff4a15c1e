"""What each actor did, as a history a checker can read back: one JSON-lines file per process.

With ``PARKWAY_HISTORY=1`` every actor appends one compact record per fact, at the point where the fact
becomes true (a dispatch, a model call issued, a mutation applied, a seal, a snapshot step...), to

    $PARKWAY_STATE_DIR/history/<run>/<role>-<replica>-<pid>.jsonl

(``<pid>.<k>`` for the k-th incarnation of one actor inside one process, as in embedded runs).

The records are the typed kinds of ``parkway.protocol.history``; ``History.record`` fills in the common
fields (``t``, the wall clock, the same for every process of one machine; ``n``, this file's record
number; ``actor``, ``pid`` and ``inc``, the incarnation: the pid, or ``<pid>.<k>``).

Each record is one ``write(2)`` on a file opened ``O_APPEND``: it is in the kernel the moment the call
returns, so a process killed with SIGKILL right after keeps every record it made, and records of
different processes never interleave inside a line. Without the variable, ``record`` is a no-op: a
normal run pays one attribute check per fact.

``parkway.actors.chaos.check`` reads these files back and verifies a run's invariants over them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import msgspec
from parkway.protocol.history import (
    HistoryFormatError,
    Record,
    encode_line,
    parse_line,
)
from parkway.protocol.layout import HISTORY_DIR

__all__ = [
    "HISTORY_DIR",
    "HISTORY_ENV",
    "History",
    "HistoryFormatError",
    "Record",
    "history_dir",
    "history_enabled",
    "parse_line",
    "read_file",
    "read_history",
]

HISTORY_ENV = "PARKWAY_HISTORY"
_ON = frozenset({"1", "true", "yes", "on"})

_incarnations: dict[str, int] = {}  # actor -> histories made for it in this process


def history_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (environ if environ is not None else os.environ).get(HISTORY_ENV, "").strip().lower() in _ON


def history_dir(state_root: Path, run: str) -> Path:
    return state_root / HISTORY_DIR / run


class History:
    """One actor's history file, or nothing (``enabled`` False)."""

    def __init__(self, path: Path | None, actor: str, incarnation: str = "") -> None:
        self.path = path
        self.actor = actor
        self.incarnation = incarnation or str(os.getpid())
        self.enabled = path is not None
        self._fd: int | None = None
        self._n = 0

    @classmethod
    def from_env(cls, run: str, actor: str, environ: Mapping[str, str] | None = None) -> History:
        env = environ if environ is not None else os.environ
        if not history_enabled(env):
            return cls(None, actor)
        root = Path(env.get("PARKWAY_STATE_DIR", ".parkway"))
        count = _incarnations[actor] = _incarnations.get(actor, 0) + 1
        incarnation = str(os.getpid()) if count == 1 else f"{os.getpid()}.{count}"
        name = f"{actor.replace('/', '-')}-{incarnation}.jsonl"
        return cls(history_dir(root, run) / name, actor, incarnation)

    def record(self, fact: Record, /) -> None:
        """Append one record (its common fields filled in here)."""
        if not self.enabled:
            return
        if self._fd is None:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._n += 1
        stamped = msgspec.structs.replace(
            fact, t=time.time(), n=self._n, actor=self.actor, pid=os.getpid(), inc=self.incarnation
        )
        os.write(self._fd, encode_line(stamped))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_file(path: Path) -> Iterator[Record]:
    """The records of one file. A last line cut short (its process was killed mid-write) is skipped;
    any other bad line raises ``HistoryFormatError`` naming the file and line."""
    lines = path.read_bytes().split(b"\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield parse_line(line, f"{path.name}:{number}")
        except HistoryFormatError:
            if number == len(lines):  # no newline after it: the write was cut by a kill
                return
            raise


def read_history(directory: Path) -> list[Record]:
    """Every record of a run's history directory, in time order (ties: by file, then record number)."""
    records: list[Record] = []
    for path in sorted(directory.glob("*.jsonl")):
        records.extend(read_file(path))
    records.sort(key=lambda r: (r.t, r.actor, r.inc, r.n))
    return records
