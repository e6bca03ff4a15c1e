"""What each actor did, as a history a checker can read back: one JSON-lines file per process.

With ``PARKWAY_HISTORY=1`` every actor appends one compact record per fact, at the point where the fact
becomes true (a dispatch, a model call issued, a mutation applied, a seal, a snapshot step...), to

    $PARKWAY_STATE_DIR/history/<run>/<role>-<replica>-<pid>.jsonl

(``<pid>.<k>`` for the k-th incarnation of one actor inside one process, as in embedded runs).

Each record is one ``write(2)`` on a file opened ``O_APPEND``: it is in the kernel the moment the call
returns, so a process killed with SIGKILL right after keeps every record it made, and records of
different processes never interleave inside a line. Fields every record has: ``t`` (wall clock, the same
clock for every process of one machine), ``n`` (this file's record number), ``k`` (the kind), ``actor``,
``pid`` and ``inc`` (the incarnation: the pid, or ``<pid>.<k>``). Without
the variable, ``record`` is a no-op: a normal run pays one attribute check per fact.

``chaos.check`` reads these files back and verifies a run's invariants over them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

HISTORY_ENV = "PARKWAY_HISTORY"
HISTORY_DIR = "history"
_ON = frozenset({"1", "true", "yes", "on"})

_encode = msgspec.json.Encoder().encode
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

    def record(self, kind: str, /, **fields: Any) -> None:
        if not self.enabled:
            return
        if self._fd is None:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._n += 1
        record = {
            "t": time.time(),
            "n": self._n,
            "k": kind,
            "actor": self.actor,
            "pid": os.getpid(),
            "inc": self.incarnation,
        }
        record.update(fields)
        os.write(self._fd, _encode(record) + b"\n")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True, slots=True)
class Record:
    """One line of a history file: the common fields, and the rest as ``fields``."""

    t: float
    n: int
    kind: str
    actor: str
    pid: int
    inc: str  # the incarnation: one process's run of one actor
    fields: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @property
    def role(self) -> str:
        return self.actor.split("/", 1)[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "n": self.n,
            "k": self.kind,
            "actor": self.actor,
            "pid": self.pid,
            "inc": self.inc,
            **self.fields,
        }

    def line(self, t0: float = 0.0) -> str:
        """One readable line: time since ``t0``, actor and pid, kind, then the other fields."""
        rest = " ".join(f"{key}={_short(value)}" for key, value in self.fields.items())
        return f"{self.t - t0:9.3f}s {self.actor:<13} {self.inc:>9} {self.kind:<18} {rest}".rstrip()


def _short(value: Any, limit: int = 160) -> str:
    text = _encode(value).decode() if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


_COMMON = ("t", "n", "k", "actor", "pid", "inc")


class HistoryFormatError(ValueError):
    """A history line that is not a record; names the file and line."""


def parse_line(line: bytes | str, where: str = "") -> Record:
    try:
        data = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise HistoryFormatError(f"{where}: not JSON: {exc}") from None
    if not isinstance(data, dict) or any(key not in data for key in _COMMON):
        raise HistoryFormatError(f"{where}: a record needs the fields {', '.join(_COMMON)}")
    common = {key: data.pop(key) for key in _COMMON}
    if not isinstance(common["t"], int | float) or not isinstance(common["n"], int):
        raise HistoryFormatError(f"{where}: t must be a number and n an integer")
    return Record(
        t=float(common["t"]),
        n=common["n"],
        kind=str(common["k"]),
        actor=str(common["actor"]),
        pid=int(common["pid"]),
        inc=str(common["inc"]),
        fields=data,
    )


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


@dataclass
class RunHistory:
    """What the checker reads: the records of one run, and its snapshots as found on disk."""

    records: list[Record]
    # snapshot directory name -> problems a deep check found (empty: it verifies)
    snapshots: dict[str, list[str]] = field(default_factory=dict)
    chaos: bool = False  # a chaos run must show faults, and work after each one


def load_run(state_root: Path, run: str, *, chaos: bool = False) -> RunHistory:
    """A run's history files and its snapshots (each checked in depth) under one state root."""
    from parkway.actors.storage.inventory import check_snapshot, list_snapshots

    directory = history_dir(state_root, run)
    if not directory.is_dir():
        raise FileNotFoundError(f"no history of run {run!r} under {state_root} (was {HISTORY_ENV}=1 set?)")
    snapshots = {
        path.name: [p.message for p in check_snapshot(path, deep=True)]
        for _, path in list_snapshots(state_root / "snapshots" / run)
    }
    return RunHistory(read_history(directory), snapshots, chaos)
