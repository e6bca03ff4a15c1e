"""A trainer checkpoint whose files cannot be written, in a real ``parkway run`` process: the write is
tried again with a pause, the failure is logged and counted, and the run goes on to its end.

Root ignores file modes, so chmod would not stop these writes: the run's trainer directory is made a
plain file instead (every write under it fails, as on a broken disk), or the fault point
``trainer_checkpoint_write`` fails the first write once (storage that comes back).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import parkway

pytestmark = [pytest.mark.slow]

RUN = "trainer-ck"
CONFIG = f"""
run: {RUN}
seed: 5
rollout: {{group_size: 2, max_turns: 3}}
tasks: {{builtin: counter, limit: 3}}
policy: {{host: inline}}
topology: {{agents: 1, resources: 1}}
trainer: {{batch_groups: 1, checkpoint_every: 1, checkpoint_retries: 2, checkpoint_retry_s: 0.01}}
snapshot_interval_s: 0.5
"""
STEPS = 3  # one group a step, three tasks


def events(stderr: str, name: str) -> list[dict[str, Any]]:
    found = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if event.get("event") == name:
                    found.append(event)
    return found


def run(tmp_path: Path, **variables: str) -> tuple[int, dict[str, Any], str]:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    done = parkway(
        "run",
        "--config",
        str(config),
        "--json",
        "--log-level",
        "info",
        timeout=240,
        PARKWAY_STATE_DIR=str(tmp_path / "state"),
        **variables,
    )
    summary = json.loads(done.stdout) if done.returncode == 0 else {}
    return done.returncode, summary, done.stderr


def test_a_trainer_directory_that_cannot_be_written_costs_the_markers_not_the_run(tmp_path: Path) -> None:
    trainer_dir = tmp_path / "state" / "snapshots" / RUN / "trainer"
    trainer_dir.parent.mkdir(parents=True)
    trainer_dir.write_text("not a directory\n")  # every write under it fails, for root too

    code, summary, stderr = run(tmp_path)
    assert code == 0, stderr[-3000:]
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6, summary
    assert summary["train_steps"] == STEPS and summary["rollouts_failed"] == 0, summary
    failed = events(stderr, "trainer_checkpoint_failed")
    given_up = events(stderr, "trainer_checkpoint_given_up")
    assert [e["step"] for e in given_up] == list(range(1, STEPS + 1))  # each step tried, none written
    assert all(e["tries"] == 3 for e in given_up)  # the first try and checkpoint_retries more
    assert len(failed) == 2 * STEPS and all(e["retry_in_s"] > 0 for e in failed)
    assert "Not a directory" in given_up[0]["detail"] or "File exists" in given_up[0]["detail"]
    assert trainer_dir.read_text() == "not a directory\n"
    assert summary["snapshots_published"] >= 1  # the snapshots themselves were not stopped by it


def test_a_trainer_checkpoint_write_that_fails_once_is_written_on_the_retry(tmp_path: Path) -> None:
    code, summary, stderr = run(tmp_path, PARKWAY_FAULTS="trainer_checkpoint_write=EIO@1")
    assert code == 0, stderr[-3000:]
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6, summary
    [failed] = events(stderr, "trainer_checkpoint_failed")
    assert failed["step"] == 1 and "Input/output error" in failed["detail"], failed
    assert [(e["step"], e["tries"]) for e in events(stderr, "trainer_checkpoint_written")] == [(1, 2)]
    assert events(stderr, "trainer_checkpoint_given_up") == []
    trainer_dir = tmp_path / "state" / "snapshots" / RUN / "trainer"
    markers = sorted(p.name for p in trainer_dir.glob("fallback_*.msgpack"))
    assert markers == [f"fallback_{step}.msgpack" for step in range(1, STEPS + 1)]
