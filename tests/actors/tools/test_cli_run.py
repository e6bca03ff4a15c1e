"""``parkway run`` as a user runs it: embedded, JSON summary, exit codes, config errors."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.support.cli import parkway
from tests.support.paths import ROOT

pytestmark = pytest.mark.slow  # each runs `parkway run` as a process


def test_run_prints_one_json_summary(tmp_path: Path) -> None:
    result = parkway("run", "--config", str(ROOT / "examples" / "live-failures.yaml"), "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    for key in (
        "rollouts_expected",
        "rollouts_sealed",
        "rollouts_failed",
        "turns_generated",
        "model_calls",
        "tool_calls",
        "tool_mutations_applied",
        "train_steps",
        "wall_s",
    ):
        assert key in summary, key
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 12
    assert (summary["attempts_failed"], summary["rollouts_redone"]) == (1, 1)


def test_environment_overrides_reach_the_run(tmp_path: Path) -> None:
    result = parkway(
        "run",
        "--config",
        str(ROOT / "examples" / "live-failures.yaml"),
        "--json",
        cwd=tmp_path,
        PARKWAY_CFG__RECOVERY__DEFAULT_GRANULARITY="prompt_group",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rollouts_redone"] == 3


def test_a_run_with_failed_rollouts_exits_1(tmp_path: Path) -> None:
    result = parkway(
        "run",
        "--json",
        cwd=tmp_path,
        PARKWAY_CFG__POLICY__HOST="inline",
        PARKWAY_CFG__ROLLOUT__MAX_TOKENS="20",
        PARKWAY_CFG__ROLLOUT__MAX_ATTEMPTS="1",
        PARKWAY_CFG__TASKS__LIMIT="1",
    )
    assert result.returncode == 1
    assert json.loads(result.stdout)["rollouts_failed"] == 3


def test_a_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  max_turnz: 3\n")
    result = parkway("run", "--config", str(bad), cwd=tmp_path)
    assert result.returncode == 2 and "rollout.max_turnz: unknown key" in result.stderr


def test_run_takes_a_metrics_port_and_says_when_it_is_taken(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = str(ROOT / "examples" / "live-failures.yaml")
        result = parkway("run", "--config", config, "--metrics-port", str(port), cwd=tmp_path)
    assert result.returncode == 2 and f"cannot serve metrics on port {port}" in result.stderr


def test_the_progress_line_counts_up_to_the_end_and_stays_out_of_json(tmp_path: Path) -> None:
    config = str(ROOT / "examples" / "live-failures.yaml")
    shown = parkway("run", "--config", config, "--progress", "always", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stderr.splitlines() if line.startswith("run live-failures ")]
    assert lines and "running" in lines[0]
    summary = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    expected = summary["rollouts_expected"]
    assert f"{expected}/{expected} sealed" in lines[-1]  # the last update is the finished run
    assert all(not line.startswith("run ") for line in shown.stdout.splitlines())  # stdout stays clean
    # Not a terminal (auto) and --json: not one progress line.
    (tmp_path / "again").mkdir()
    quiet = parkway("run", "--config", config, "--json", cwd=tmp_path / "again")
    assert quiet.returncode == 0 and "sealed" not in quiet.stderr
    assert json.loads(quiet.stdout)["rollouts_sealed"] == int(expected)


def test_a_run_that_snapshots_cannot_protect_says_so_and_exits_3(tmp_path: Path) -> None:
    """Snapshots failing in a row end the run when the operator configured it
    (snapshots.end_after_failures): a message naming why and how to go on, exit 3 (a supervisor starts
    it again; it restores the newest snapshot), no traceback."""
    import yaml

    from tests.support.embedded import SNAPSHOT_RUN

    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **SNAPSHOT_RUN,
                "policy": {"host": "inline", "per_token_delay_s": 0.002},
                "snapshots": {"end_after_failures": 3},
            }
        )
    )
    result = parkway(
        "run",
        "--config",
        str(config),
        cwd=tmp_path,
        PARKWAY_STATE_DIR=str(tmp_path / "state"),
        PARKWAY_FAULTS="commit_write:agent=ENOSPC@2+",  # a disk that fills up after the first snapshot
    )
    assert result.returncode == 3, result.stderr
    assert "parkway: snapshots: 3 snapshots failed in a row" in result.stderr
    assert "No space left on device" in result.stderr and "Traceback" not in result.stderr
