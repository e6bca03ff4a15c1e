"""``parkway demo``: one group of three siblings killed at 5, 2 and 4 turns; sibling throws 6 away, turn 0."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from parkway.actors.launch.processes import clean_environment

pytestmark = pytest.mark.slow  # `parkway demo` in its own process


def test_the_demo_throws_away_six_turns_under_sibling_and_none_under_turn(tmp_path) -> None:
    env = clean_environment()
    result = subprocess.run(
        [sys.executable, "-m", "parkway.actors", "demo", "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    by_level = {row["level"]: row for row in json.loads(result.stdout)}
    for row in by_level.values():
        assert row["turns_at_snapshot"] == {"t0000_g0": 5, "t0000_g1": 2, "t0000_g2": 4}
        assert row["rollouts_sealed"] == 3
    assert by_level["sibling"]["turns_regenerated"] == {"t0000_g0": 0, "t0000_g1": 2, "t0000_g2": 4}
    assert by_level["sibling"]["turns_thrown_away"] == 6
    assert by_level["turn"]["turns_thrown_away"] == 0
