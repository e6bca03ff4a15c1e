"""What the snapshots of one run cost: counts, pauses, step durations, bytes (for the run summary,
the progress line and the benchmarks; Prometheus has its own in ``runtime.metrics``)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from parkway.protocol.snapshot_failures import FailureStreak

# Per-snapshot samples kept: the newest this many, so a run of days holds as much as one of an hour
# (the summary's p50/p95 are over them; the counts above are over the whole run).
METRICS_KEEP = 4096


def _recent() -> deque[float]:
    return deque(maxlen=METRICS_KEEP)


def _recent_records() -> deque[SnapshotRecord]:
    return deque(maxlen=METRICS_KEEP)


class SnapshotRecord(TypedDict):
    """One published snapshot."""

    pause_ms: float  # the admission gate's closed window
    rollouts: int  # rollouts saved
    parked: int  # rollouts that parked at a boundary
    bytes: int  # every file it holds and the manifest
    bytes_written: int  # of which written by it: the rest are packs linked from the snapshot before
    park_wait_ms: float  # the longest an agent waited for its rollouts to reach a boundary
    steps_ms: dict[str, float]  # each save step's duration


@dataclass
class SnapshotMetrics:
    published: int = 0
    failed: int = 0
    skipped: int = 0
    streak: FailureStreak = field(default_factory=FailureStreak)  # failures in a row, the newest snapshot
    pause_ms: deque[float] = field(default_factory=_recent)
    phases_ms: dict[str, deque[float]] = field(default_factory=dict)
    restores: int = 0
    rollouts_restored: int = 0
    records: deque[SnapshotRecord] = field(default_factory=_recent_records)

    def step_took(self, step: str, ms: float) -> None:
        self.phases_ms.setdefault(step, _recent()).append(ms)

    def sizes(self) -> dict[str, int]:
        """Entries kept per snapshot (``structure_sizes``): each at most ``METRICS_KEEP``."""
        return {
            "snapshot_records": len(self.records),
            "snapshot_pauses": len(self.pause_ms),
            "snapshot_step_samples": max((len(v) for v in self.phases_ms.values()), default=0),
        }

    def pause_summary(self) -> dict[str, float]:
        return percentiles(self.pause_ms)

    def phases_summary(self) -> dict[str, float]:
        """The median duration of each save step, in milliseconds."""
        return {step: percentiles(values)["p50"] for step, values in self.phases_ms.items()}

    def bytes_summary(self) -> dict[str, float]:
        """Bytes each published snapshot holds (every file and the manifest): p50, p95, max."""
        return percentiles([float(r["bytes"]) for r in self.records])

    def bytes_written_summary(self) -> dict[str, float]:
        """Bytes each published snapshot wrote (what did not change was linked): p50, p95, max."""
        return percentiles([float(r["bytes_written"]) for r in self.records])


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "max": 0.0}
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 99
    return {"p50": round(q[49], 3), "p95": round(q[94], 3), "max": round(ordered[-1], 3)}
