"""The workspace benchmark's cluster pause (``bench/workspace.py``), with a short command: its snapshot
really is taken while the command runs (the same process before it and after its resume), and its
baseline has none running. No timing is asserted: the figures are the benchmark's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is scripts

import workspace

pytestmark = pytest.mark.slow  # commands are processes


async def test_the_in_flight_snapshot_is_taken_while_the_command_runs(tmp_path: Path) -> None:
    point = await workspace.cluster_pause("sleep 2", True, 0.01, tmp_path)
    assert point["rollouts"] == 1 and point["running_at_snapshot"] == 1
    assert point["ran_through"] and point["left_running"] == 0


async def test_the_baseline_snapshot_has_no_command_running(tmp_path: Path) -> None:
    point = await workspace.cluster_pause("true", False, 0.01, tmp_path)
    assert point["rollouts"] == 1 and point["running_at_snapshot"] == 0
    assert not point["ran_through"] and point["left_running"] == 0
