"""A restore in front of damaged snapshots: real ones (a run stopped dead after its second snapshot),
then the newest damaged one way at a time. The restore passes over it with a warning that names it
and says what is wrong, restores the one before, and the run completes with the transcripts of a run
that never crashed. When no snapshot of this work verifies, a start refuses to begin afresh over them
(it would silently drop their rollouts) and says which and why; ``parkway run`` exits 2 with that."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import yaml
from parkway.actors.launch.processes import clean_environment
from parkway.actors.roles.controller.controller import RunSummary
from parkway.actors.storage.inventory import inventory
from parkway.actors.storage.select import NoValidSnapshot

from tests.support.embedded import SNAPSHOT_RUN, crashed_run, embedded_run

NEWEST = "snapshot_2"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return asyncio.run(crashed_run(tmp_path_factory.mktemp("pristine")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> RunSummary:
    return asyncio.run(embedded_run(SNAPSHOT_RUN, tmp_path_factory.mktemp("reference"), snapshots=False))


@pytest.fixture
def state(pristine: Path, tmp_path: Path) -> Path:
    """A state root holding a copy of the crashed run's snapshots."""
    shutil.copytree(pristine, tmp_path / "snapshots" / pristine.name)
    return tmp_path


def manifest_of(snapshot: Path) -> dict[str, Any]:
    return json.loads((snapshot / "manifest.json").read_text())


def rewrite(snapshot: Path, **changes: Any) -> None:
    (snapshot / "manifest.json").write_text(json.dumps({**manifest_of(snapshot), **changes}, indent=1))


def flip_a_bit(snapshot: Path) -> None:
    path = snapshot / "participants" / "agent" / "0" / "rollouts.msgpack"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x04
    path.write_bytes(bytes(data))


def truncate(snapshot: Path) -> None:
    path = snapshot / "tq" / "staging.msgpack"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def remove_a_file(snapshot: Path) -> None:
    (snapshot / "participants" / "resources" / "1" / "sessions.msgpack").unlink()


def wrong_digest(snapshot: Path) -> None:
    manifest = manifest_of(snapshot)
    entry = next(e for e in manifest["files"] if e["path"] == "ledger.msgpack")
    entry["sha256"] = hashlib.sha256(b"something else").hexdigest()
    rewrite(snapshot, files=manifest["files"])


def another_run(snapshot: Path) -> None:
    rewrite(snapshot, run="elsewhere")


def another_config(snapshot: Path) -> None:
    rewrite(snapshot, config_fingerprint=hashlib.sha256(b"other work").hexdigest())


def not_json(snapshot: Path) -> None:
    (snapshot / "manifest.json").write_text('{"schema": 1, "files": [')


def no_manifest(snapshot: Path) -> None:
    (snapshot / "manifest.json").unlink()


def episodes_off_the_ledger(snapshot: Path) -> None:
    manifest = manifest_of(snapshot)
    rewrite(snapshot, episodes=manifest["episodes"][1:])


def ledger_unlisted(snapshot: Path) -> None:
    manifest = manifest_of(snapshot)
    rewrite(snapshot, files=[e for e in manifest["files"] if e["path"] != "ledger.msgpack"])
    (snapshot / "ledger.msgpack").unlink()


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped bit": (flip_a_bit, "participants/agent/0/rollouts.msgpack does not match its sha256"),
    "truncated file": (truncate, "tq/staging.msgpack is"),
    "missing file": (remove_a_file, "participants/resources/1/sessions.msgpack is missing"),
    "wrong digest": (wrong_digest, "ledger.msgpack does not match its sha256"),
    "manifest of another run": (another_run, "names run 'elsewhere'"),
    "manifest of another config": (another_config, "written under another configuration"),
    "manifest not JSON": (not_json, "manifest.json is not valid JSON"),
    "manifest missing": (no_manifest, "manifest.json is missing"),
    # Both of these ended the restore (and the run) before: now the snapshot is passed over.
    "episodes the ledger did not dispatch": (episodes_off_the_ledger, "ledger.msgpack disagrees"),
    "ledger not listed": (ledger_unlisted, "ledger.msgpack is not listed in the manifest"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
async def test_a_damaged_newest_snapshot_falls_back_to_the_one_before(
    state: Path, reference: RunSummary, damage: str
) -> None:
    run_dir = state / "snapshots" / SNAPSHOT_RUN["run"]
    before = manifest_of(run_dir / "snapshot_1")
    damage_it, reason = DAMAGE[damage]
    damage_it(run_dir / NEWEST)
    with structlog.testing.capture_logs() as logs:
        resumed = await embedded_run(SNAPSHOT_RUN, state)
    [skipped] = [e for e in logs if e["event"] == "snapshot_skipped" and e.get("snapshot") == NEWEST]
    assert reason in skipped["reason"] and skipped["log_level"] == "warning"
    [started] = [e for e in logs if e["event"] == "restore_started"]
    assert (started["snapshot"], started["saved_checkpoint"]) == ("snapshot_1", before["checkpoint_id"])
    assert resumed.restores == 1 and resumed.rollouts_restored == len(before["episodes"]) > 0
    assert resumed.rollouts_sealed == 9 and resumed.rollouts_failed == 0
    assert resumed.transcripts_sha256 == reference.transcripts_sha256


async def test_a_snapshot_whose_anchor_predates_the_sums_and_the_cursor_still_restores(
    state: Path, reference: RunSummary
) -> None:
    # Older snapshots saved every rollout the trainer received with its reward (``sealed_rows``)
    # instead of the sums, and had no task cursor (every task was admitted at the start). Two rows
    # more than the snapshot's own sums say show that the restore counts from them.
    snapshot = state / "snapshots" / SNAPSHOT_RUN["run"] / NEWEST
    ledger = snapshot / "ledger.msgpack"
    record = msgspec.msgpack.decode(ledger.read_bytes())
    anchor = record["controller"]
    sealed, reward_sum = anchor.pop("sealed"), anchor.pop("reward_sum")
    for newer in ("transcripts", "next_task", "first_in_play", "trained_groups"):
        del anchor[newer]
    rows = {f"trained_{i}": reward_sum / sealed for i in range(sealed)}
    anchor["sealed_rows"] = {**rows, "older_0": 1.0, "older_1": 0.0}
    data = msgspec.msgpack.encode(record)
    ledger.write_bytes(data)
    manifest = manifest_of(snapshot)
    entry = next(e for e in manifest["files"] if e["path"] == "ledger.msgpack")
    entry.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    rewrite(snapshot, files=manifest["files"])

    with structlog.testing.capture_logs() as logs:
        resumed = await embedded_run(SNAPSHOT_RUN, state)
    [started] = [e for e in logs if e["event"] == "restore_started"]
    assert started["snapshot"] == NEWEST and resumed.restores == 1 and resumed.rollouts_restored > 0
    assert resumed.rollouts_failed == 0 and resumed.rollouts_sealed == 9 + 2
    assert resumed.mean_reward == pytest.approx((9 * reference.mean_reward + 1.0) / 11)


async def test_when_no_snapshot_verifies_a_start_refuses_to_begin_afresh(state: Path) -> None:
    run_dir = state / "snapshots" / SNAPSHOT_RUN["run"]
    flip_a_bit(run_dir / NEWEST)
    no_manifest(run_dir / "snapshot_1")
    with pytest.raises(NoValidSnapshot) as info, structlog.testing.capture_logs() as logs:
        await embedded_run(SNAPSHOT_RUN, state)
    message = str(info.value)
    assert "no snapshot of run 'snaps' verifies" in message and "discard" in message
    assert "snapshot_1: manifest.json is missing" in message
    assert f"{NEWEST}: participants/agent/0/rollouts.msgpack does not match its sha256" in message
    assert "parkway snapshots verify --run snaps" in message and str(run_dir) in message
    assert [e["event"] for e in logs if e["log_level"] == "error"][:1] == ["no_valid_snapshot"]
    assert not (run_dir / "COMPLETED").exists() and len(list(run_dir.glob("snapshot_*"))) == 2  # untouched
    found = inventory(run_dir)
    assert found.selected is None and found.restore_detail.startswith(
        "no snapshot verifies (snapshot_1, snapshot_2): a start refuses to begin afresh"
    )

    # Moved away, as the message says: the run starts afresh and completes.
    shutil.move(run_dir, state / "kept-aside")
    fresh = await embedded_run(SNAPSHOT_RUN, state)
    assert fresh.restores == 0 and fresh.rollouts_sealed == 9


@pytest.mark.slow  # `parkway run` as a process
def test_parkway_run_exits_2_naming_what_is_wrong(state: Path) -> None:
    run_dir = state / "snapshots" / SNAPSHOT_RUN["run"]
    for snapshot in run_dir.glob("snapshot_*"):
        truncate(snapshot)
    config = state / "run.yaml"
    config.write_text(yaml.safe_dump(SNAPSHOT_RUN))
    env = clean_environment()
    result = subprocess.run(
        [sys.executable, "-m", "parkway.actors", "run", "--config", str(config), "--json"],
        env={**env, "PARKWAY_STATE_DIR": str(state)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("parkway: restore: no snapshot of run 'snaps' verifies")
    assert "snapshot_1: tq/staging.msgpack is" in last and "snapshot_2: tq/staging.msgpack is" in last
    assert result.stdout == ""
