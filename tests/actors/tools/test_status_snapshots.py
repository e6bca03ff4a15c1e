"""``parkway status`` on the controller's row: the newest snapshot's age and the last failure."""

from __future__ import annotations

import msgspec
from parkway.actors.tools.status import snapshot_note, table
from parkway.protocol.snapshot_failures import FailureStreak


def test_the_controller_row_names_the_newest_snapshot_and_the_last_failure() -> None:
    streak = FailureStreak()
    streak.published("snapshot_3", created_at=1000.0)
    streak.failed("commit", "agent/0: unavailable: [Errno 20] Not a directory", now=1040.0)
    streak.failed("commit", "agent/0: unavailable: [Errno 20] Not a directory", now=1050.0)
    row = {
        "address": "controller/0",
        "role": "controller",
        "replica": 0,
        "reachable": True,
        "phase": "serving",
        "heard_at": 1059.0,
        "snapshots": msgspec.to_builtins(streak.health()),
    }
    note = "newest snapshot_3, 60.0s ago; 2 failed in a row; last failure at commit 10.0s ago: " + (
        "agent/0: unavailable: [Errno 20] Not a directory"
    )
    assert snapshot_note(row["snapshots"], now=1060.0) == note
    assert table([row], now=1060.0).splitlines()[1].endswith(note)


def test_a_participant_row_has_no_snapshot_note() -> None:
    assert snapshot_note(None, now=0.0) == ""
    assert snapshot_note(msgspec.to_builtins(FailureStreak().health()), now=0.0) == "no snapshot yet"
