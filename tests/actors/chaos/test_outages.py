"""The harness's outages: a process stops itself at an exact point, and the state directory is made
unwritable (for root too) and given back whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from parkway.actors.chaos.cluster import Cluster
from parkway.actors.chaos.outages import (
    OutageError,
    is_stopped,
    make_unwritable,
    make_writable,
    stopped_at,
)
from parkway.actors.runtime.faults import STOPPED_LINE, FaultPoints, FaultSpecError

REACHES = """
from parkway.actors.runtime.faults import FaultPoints
points = FaultPoints("save_prepare=STOP@2")
for hit in range(3):
    points.reach("save_prepare")
    print("went on after hit", hit, flush=True)
"""


@pytest.mark.slow
def test_a_stop_point_stops_the_process_at_its_hit_until_it_is_continued(tmp_path: Path) -> None:
    err = tmp_path / "err"
    with open(err, "wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", REACHES], stdout=subprocess.PIPE, stderr=stderr, env=os.environ.copy()
        )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"went on after hit 0\n"  # the first hit goes through
        while not is_stopped(child.pid):  # the second stops it (bounded by the test's own timeout)
            assert child.poll() is None, err.read_text()
            time.sleep(0.01)
        assert stopped_at(err.read_text()) == "save_prepare"
        assert child.poll() is None
        child.send_signal(signal.SIGCONT)
        assert child.stdout.read() == b"went on after hit 1\nwent on after hit 2\n"  # once only
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        child.wait()


def test_a_stop_point_is_read_and_a_bad_action_named() -> None:
    FaultPoints("restore_discover=STOP,after_commit@2")
    with pytest.raises(FaultSpecError, match="'HALT' is not an errno name"):
        FaultPoints("save_prepare=HALT")
    text = "\n".join([STOPPED_LINE.format(point="save_commit"), '{"event": "x"}'])
    assert stopped_at(text + "\n" + STOPPED_LINE.format(point="after_publish")) == "after_publish"
    assert stopped_at('{"event": "x"}') is None
    assert not is_stopped(os.getpid())


async def test_a_hold_point_holds_only_the_hits_it_is_armed_for_and_only_where_awaited() -> None:
    import asyncio

    points = FaultPoints("tq_seal=HOLD@2+")
    await points.hold("tq_seal")  # the first hit goes on
    held = [asyncio.ensure_future(points.hold("tq_seal")) for _ in range(2)]
    done, pending = await asyncio.wait(held, timeout=0.05)
    assert not done and len(pending) == 2  # the second and every later hit wait for good
    for task in held:
        task.cancel()
    with pytest.raises(FaultSpecError, match="HOLD is for an awaited point"):
        FaultPoints("save_prepare=HOLD")


def test_an_unwritable_snapshot_directory_refuses_every_write_and_comes_back_whole(tmp_path: Path) -> None:
    run = tmp_path / "snapshots" / "run1"
    (run / "snapshot_1").mkdir(parents=True)
    (run / "snapshot_1" / "manifest.json").write_text("{}")
    make_unwritable(run)
    with pytest.raises(NotADirectoryError):  # as root too: no chmod involved
        (run / "tmp_ck").mkdir(parents=True)
    with pytest.raises(NotADirectoryError):
        (run / "snapshot_1" / "manifest.json").write_text("{}")
    with pytest.raises(OutageError, match="never repaired"):
        make_unwritable(run)
    make_writable(run)
    assert (run / "snapshot_1" / "manifest.json").read_text() == "{}"
    assert sorted(p.name for p in run.parent.iterdir()) == ["run1"]
    with pytest.raises(OutageError, match="no longer the file"):
        make_writable(run)


def test_an_unplanned_exit_is_explained_by_the_line_the_command_ended_on(tmp_path: Path) -> None:
    cluster = Cluster(url="", run="r", state=tmp_path, config=tmp_path, secret="s", logs=tmp_path)
    cluster.starts["controller"] = 1
    log = tmp_path / "controller-1.log"
    log.write_text(
        "\n".join(
            [
                STOPPED_LINE.format(point="save_prepare"),
                "parkway: snapshots: 3 snapshots failed in a row; last at prepare: ...",
                "Future exception was never retrieved",
                "parkway.brokers.base.BrokerError: the broker connection was lost",
            ]
        )
    )
    assert (
        cluster.exit_reason("controller")
        == "parkway: snapshots: 3 snapshots failed in a row; last at prepare: ..."
    )
    log.write_text("one\ntwo\nthree\nfour\n")
    assert cluster.exit_reason("controller") == "two | three | four"
