"""The failure streak of a controller's snapshots: back-off, the operator's end-of-run choice, health."""

from __future__ import annotations

from parkway.protocol.snapshot_failures import FailurePolicy, FailureStreak, SnapshotHealth


def test_the_wait_doubles_from_the_interval_and_is_capped() -> None:
    policy = FailurePolicy(interval_s=2.0, backoff_max_s=30.0)
    assert [policy.wait_s(n) for n in range(8)] == [2.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert policy.wait_s(10_000) == 30.0  # (no overflow)
    # A cap below the interval never makes a retry come sooner than the interval.
    assert FailurePolicy(interval_s=60.0, backoff_max_s=10.0).wait_s(3) == 60.0


def test_by_default_no_number_or_duration_of_failures_ends_the_run() -> None:
    streak, policy = FailureStreak(), FailurePolicy(interval_s=1.0, backoff_max_s=4.0)
    for n in range(1000):
        streak.failed("commit", "storage: [Errno 30] Read-only file system", now=float(n))
    assert streak.consecutive == 1000 and streak.ends_run(policy, now=1e9) is None


def test_a_configured_count_ends_the_run_at_that_failure() -> None:
    streak, policy = FailureStreak(), FailurePolicy(interval_s=1.0, backoff_max_s=4.0, end_after_failures=3)
    streak.failed("commit", "x", now=1.0)
    streak.failed("commit", "x", now=2.0)
    assert streak.ends_run(policy, now=2.0) is None
    streak.failed("publish", "y", now=3.0)
    assert streak.ends_run(policy, now=3.0) == "3 snapshots failed in a row (snapshots.end_after_failures)"


def test_a_configured_duration_counts_from_the_first_failure_in_a_row() -> None:
    streak = FailureStreak()
    policy = FailurePolicy(interval_s=1.0, backoff_max_s=4.0, end_after_failing_s=10.0)
    streak.failed("commit", "x", now=100.0)
    streak.failed("commit", "x", now=105.0)
    assert streak.ends_run(policy, now=109.9) is None
    assert streak.ends_run(policy, now=110.0) == (
        "snapshots failed for 10.0 s in a row, 2 attempts (snapshots.end_after_failing_s)"
    )
    streak.published("snapshot_4", created_at=111.0)  # a success ends the streak: the clock restarts
    streak.failed("commit", "x", now=200.0)
    assert streak.ends_run(policy, now=205.0) is None


def test_health_keeps_the_last_failure_after_a_success() -> None:
    streak = FailureStreak()
    streak.published("snapshot_1", created_at=10.0)
    streak.failed("capture", "storage: [Errno 20] Not a directory", now=12.0)
    streak.failed("capture", "storage: [Errno 20] Not a directory", now=14.0)
    assert streak.health() == SnapshotHealth(
        newest_snapshot="snapshot_1",
        newest_published_at=10.0,
        consecutive_failures=2,
        failing_since=12.0,
        last_failure_at=14.0,
        last_failure_step="capture",
        last_failure_reason="storage: [Errno 20] Not a directory",
    )
    streak.cleared()  # nothing new to save: the newest snapshot holds everything
    health = streak.health()
    assert (health.consecutive_failures, health.failing_since, health.last_failure_at) == (0, None, 14.0)
