"""What failed snapshots cost a run: the streak of failures, the back-off, and when (if ever) the run ends.

A snapshot that fails must not stop the training it exists to protect: the rollouts go on, the next
attempt waits longer each time (exponential from the interval, capped), and the run ends only when the
operator asked for it (``snapshots.end_after_failures``: a count in a row, or
``snapshots.end_after_failing_s``: how long without a published snapshot while failing). Pure: the
caller passes the clock in.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from parkway.protocol import ranges


class SnapshotHealth(msgspec.Struct, frozen=True, kw_only=True):
    """How the controller's snapshots stand (``parkway status``, the heartbeat, the metrics)."""

    newest_snapshot: str | None = None  # the newest published (or restored) ``snapshot_<seq>``
    newest_published_at: ranges.Seconds | None = None  # its manifest's ``created_at`` (wall clock)
    consecutive_failures: ranges.Count = (
        0  # failed attempts since the last one that published (or had nothing new)
    )
    failing_since: ranges.Seconds | None = None  # when the first of them failed
    last_failure_at: ranges.Seconds | None = None  # the newest failure, even once a later snapshot published
    last_failure_step: str | None = None
    last_failure_reason: str | None = None
    next_attempt_at: ranges.Seconds | None = None  # when the snapshot loop tries next


@dataclass(frozen=True)
class FailurePolicy:
    interval_s: float  # ``snapshot_interval_s``: the wait after a success
    backoff_max_s: float  # the longest wait after failures (never below the interval)
    end_after_failures: int | None = None  # failures in a row that end the run; None: never
    end_after_failing_s: float | None = None  # seconds failing in a row that end the run; None: never

    def wait_s(self, consecutive_failures: int) -> float:
        """Seconds until the next attempt: the interval after a success or a single failure (a blip
        retries at the usual cadence), then doubled per further failure in a row, capped."""
        doublings = min(max(consecutive_failures - 1, 0), 32)  # (32: no float overflow)
        return min(self.interval_s * 2.0**doublings, max(self.backoff_max_s, self.interval_s))


@dataclass
class FailureStreak:
    """The controller's record of its snapshots' outcomes (mutable; one per controller)."""

    newest_snapshot: str | None = None
    newest_published_at: ranges.Seconds | None = None
    consecutive: int = 0
    failing_since: ranges.Seconds | None = None
    last_failure_at: ranges.Seconds | None = None
    last_failure_step: str | None = None
    last_failure_reason: str | None = None
    next_attempt_at: ranges.Seconds | None = None

    def published(self, snapshot: str, created_at: float) -> None:
        """A snapshot was published (or restored from, at start): the streak ends."""
        self.newest_snapshot, self.newest_published_at = snapshot, created_at
        self.cleared()

    def cleared(self) -> None:
        """An attempt found nothing new to save: the newest snapshot holds everything, the streak ends."""
        self.consecutive, self.failing_since = 0, None

    def failed(self, step: str, reason: str, now: float) -> None:
        self.consecutive += 1
        if self.failing_since is None:
            self.failing_since = now
        self.last_failure_at, self.last_failure_step, self.last_failure_reason = now, step, reason

    def ends_run(self, policy: FailurePolicy, now: float) -> str | None:
        """Why the run ends now under ``policy``; None while it goes on (the default: always)."""
        if policy.end_after_failures is not None and self.consecutive >= policy.end_after_failures:
            return f"{self.consecutive} snapshots failed in a row (snapshots.end_after_failures)"
        if (
            policy.end_after_failing_s is not None
            and self.failing_since is not None
            and now - self.failing_since >= policy.end_after_failing_s
        ):
            return (
                f"snapshots failed for {now - self.failing_since:.1f} s in a row, {self.consecutive} "
                "attempts (snapshots.end_after_failing_s)"
            )
        return None

    def health(self) -> SnapshotHealth:
        return SnapshotHealth(
            newest_snapshot=self.newest_snapshot,
            newest_published_at=self.newest_published_at,
            consecutive_failures=self.consecutive,
            failing_since=self.failing_since,
            last_failure_at=self.last_failure_at,
            last_failure_step=self.last_failure_step,
            last_failure_reason=self.last_failure_reason,
            next_attempt_at=self.next_attempt_at,
        )
