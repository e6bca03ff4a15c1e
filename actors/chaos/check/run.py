"""What the checker reads: one run's history records and its snapshots as found on disk."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from parkway.actors.runtime.history import HISTORY_ENV, history_dir, read_history
from parkway.actors.storage.inventory import check_snapshot, list_snapshots
from parkway.protocol.history import Record
from parkway.protocol.layout import SNAPSHOTS_DIR


@dataclass
class RunHistory:
    """The records of one run, and its snapshots as found on disk."""

    records: list[Record]
    # snapshot directory name -> problems the check found (empty: it verifies)
    snapshots: dict[str, list[str]] = field(default_factory=dict)
    chaos: bool = False  # a chaos run must show faults, and work after each one


def load_run(state_root: Path, run: str, *, chaos: bool = False) -> RunHistory:
    """A run's history files and its snapshots (each checked in depth) under one state root."""
    directory = history_dir(state_root, run)
    if not directory.is_dir():
        raise FileNotFoundError(f"no history of run {run!r} under {state_root} (was {HISTORY_ENV}=1 set?)")
    snapshots = {
        path.name: [p.message for p in check_snapshot(path)]
        for _, path in list_snapshots(state_root / SNAPSHOTS_DIR / run)
    }
    return RunHistory(read_history(directory), snapshots, chaos)
