"""The soak benchmark's arithmetic (``bench/soak.py``): the growth line, the warm-up/middle/end
picks, the first and last tenth of the snapshots, and the pass/fail lines. The run itself is the
benchmark's (minutes over RabbitMQ); this checks what it concludes from its samples."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is scripts

import soak


def samples(slope_mb_per_rollout: float, *, structures: bool = True) -> list[dict[str, Any]]:
    """Samples every 1,000 rollouts up to 10,000: agent/0 grows by the slope, tq/0 stays flat."""
    return [
        {
            "rollouts": n,
            "rss_mb": {"agent/0": 40.0 + slope_mb_per_rollout * n, "tq/0": 50.0},
            "structures": {"agent/0": {"sessions": n // 10} if structures else None, "tq/0": None},
        }
        for n in range(0, 10_001, 1000)
    ]


def test_growth_is_the_slope_of_the_line_scaled_to_100k_rollouts() -> None:
    assert soak.growth_per_100k([(0, 10.0), (1000, 11.0), (2000, 12.0)]) == pytest.approx(100.0)
    assert soak.growth_per_100k([(0, 10.0), (1000, 10.0), (2000, 10.0)]) == 0.0
    assert soak.growth_per_100k([(0, 10.0), (1000, 11.0)]) is None  # too few points to say


def test_memory_rows_fit_after_warmup_and_pick_warmup_middle_end() -> None:
    result = {"samples": samples(0.001), "rollouts_sealed": 10_000}
    rows = {r["process"]: r for r in soak.memory_rows(result, 0.2)}
    agent, tq = rows["agent/0"], rows["tq/0"]
    assert agent["rss_mb"] == {"after_warmup": 42.0, "middle": 46.0, "end": 50.0}
    assert agent["growth_mb_per_100k"] == pytest.approx(100.0)
    assert agent["structures"] == {"sessions": {"after_warmup": 200, "end": 1000, "max": 1000}}
    assert tq["growth_mb_per_100k"] == 0.0
    assert tq["structures"] == {}  # no hook in that process: nothing invented
    checks = {c["check"].split(":")[0]: c["passed"] for c in soak.criteria(list(rows.values()), [])}
    assert checks == {"agent/0": False, "tq/0": True}


def test_step_rows_compare_the_first_and_last_tenth() -> None:
    snapshots = [
        {"pause_ms": 100.0, "steps_ms": {"commit": 50.0 + (20.0 if i >= 90 else 0.0), "resume": 30.0}}
        for i in range(100)
    ]
    rows = {r["step"]: r for r in soak.step_rows(snapshots)}
    assert rows["commit"]["first_tenth_ms"] == 50.0 and rows["commit"]["last_tenth_ms"] == 70.0
    assert rows["commit"]["ratio"] == pytest.approx(1.4)
    assert rows["resume"]["ratio"] == 1.0
    passed = {c["check"].split(":")[0]: c["passed"] for c in soak.criteria([], list(rows.values()))}
    assert passed == {"commit": False, "resume": True}
