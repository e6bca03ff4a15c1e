"""``bench/gate_moment.py``: windows after slow checks, read from result files written here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is scripts

import gate_moment


def result_file(
    path: Path, pairs: list[tuple[float, float]], rollouts: int = 1024, step: str = "close_gate"
) -> Path:
    records = [{"pause_ms": w, "rollouts": rollouts, "steps_ms": {step: c}} for c, w in pairs]
    path.write_text(json.dumps({"points": [{"records": records}]}))
    return path


def test_slow_checks_followed_by_long_windows_are_told_apart(tmp_path: Path) -> None:
    # 90 quick checks with short windows, 10 slow ones with long windows.
    pairs = [(5.0, 20.0 + i % 7) for i in range(90)] + [(300.0 + i, 250.0 + i) for i in range(10)]
    found = gate_moment.records_of([result_file(tmp_path / "a.json", pairs)], min_rollouts=900)
    rows = {r["quantile"]: r for r in gate_moment.foretold(found)}
    assert rows[0.0]["windows"] == 100 and rows[0.0]["long_share"] == pytest.approx(0.10)
    assert rows[0.9]["long_share"] == 1.0 and rows[0.9]["windows"] == 9  # over the 90th check
    assert rows[0.5]["long_share"] == pytest.approx(10 / 10)  # only slow checks are over the median


def test_small_snapshots_are_left_out_and_too_few_refused(tmp_path: Path, monkeypatch) -> None:
    small = result_file(tmp_path / "small.json", [(5.0, 10.0)] * 50, rollouts=16)
    assert gate_moment.records_of([small], min_rollouts=900) == []
    monkeypatch.setattr(sys, "argv", ["gate_moment.py", str(small)])
    with pytest.raises(SystemExit, match="too few to tell"):
        gate_moment.main()


def test_the_check_is_read_from_the_step_that_holds_it_now_and_before(tmp_path: Path) -> None:
    older = result_file(tmp_path / "older.json", [(5.0, 20.0)], step="close_gate")
    newer = result_file(tmp_path / "newer.json", [(7.0, 0.01)], step="instant")
    assert gate_moment.records_of([older, newer], min_rollouts=900) == [(5.0, 20.0), (7.0, 0.01)]
