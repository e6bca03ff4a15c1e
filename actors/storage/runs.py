"""One run's directory under the snapshot root: its snapshots, their temporary directories, the
trainer's checkpoints and the marker of a finished run (names from ``protocol/layout.py``)."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from parkway.protocol import layout


def list_snapshots(run_dir: Path) -> list[tuple[int, Path]]:
    """``(seq, path)`` of every ``snapshot_<seq>`` directory of a run, oldest first."""
    found = []
    for path in run_dir.glob(f"{layout.SNAPSHOT_PREFIX}*") if run_dir.is_dir() else ():
        seq = layout.parse_snapshot_dir_name(path.name)
        if seq is not None:
            found.append((seq, path))
    return sorted(found)


def trainer_steps(run_dir: Path) -> list[int]:
    """The steps of the trainer checkpoints under ``<run>/trainer/``, oldest first."""
    trainer = run_dir / layout.TRAINER_DIR
    if not trainer.is_dir():
        return []
    found = (layout.parse_trainer_state_file_name(p.name) for p in trainer.iterdir())
    return sorted(step for step in found if step is not None)


def newest_trainer_step(run_dir: Path) -> int | None:
    steps = trainer_steps(run_dir)
    return steps[-1] if steps else None


@dataclass(frozen=True)
class RunDirectory:
    """Where one run's snapshots live; the paths of its parts, and the few whole-run operations."""

    path: Path

    @property
    def run(self) -> str:
        return self.path.name

    def snapshots(self) -> list[tuple[int, Path]]:
        return list_snapshots(self.path)

    def next_seq(self) -> int:
        """The sequence number the next published snapshot takes."""
        snapshots = self.snapshots()
        return snapshots[-1][0] + 1 if snapshots else 1

    def snapshot(self, seq: int) -> Path:
        return self.path / layout.snapshot_dir_name(seq)

    def tmp(self, checkpoint_id: str) -> Path:
        return self.path / layout.tmp_dir_name(checkpoint_id)

    def temporary(self) -> list[str]:
        """The ``tmp_*`` directories: snapshots that never published (or one being written)."""
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.glob(f"{layout.TMP_PREFIX}*"))

    @property
    def trainer_dir(self) -> Path:
        return self.path / layout.TRAINER_DIR

    @property
    def completed_marker(self) -> Path:
        return self.path / layout.COMPLETED

    def completed_at(self) -> float | None:
        """When the run finished (its marker's time), or None while it has not."""
        marker = self.completed_marker
        if not marker.is_file():
            return None
        try:
            return float(marker.read_text().strip())
        except (OSError, ValueError):
            return marker.stat().st_mtime

    def mark_completed(self) -> None:
        """A finished run leaves a marker: starting the same run again starts it afresh."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.completed_marker.write_text(f"{time.time()}\n")

    def start_afresh(self) -> None:
        """A finished run starts again from nothing: its snapshots, trainer checkpoints and marker go."""
        for _, path in self.snapshots():
            shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(self.trainer_dir, ignore_errors=True)
        self.completed_marker.unlink()
