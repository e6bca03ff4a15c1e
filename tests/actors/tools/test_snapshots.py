"""``parkway snapshots list|show|verify`` as a user runs it, on the snapshots of a real (embedded) run.

The real-RabbitMQ, actors-in-processes version is ``tests/integration/test_snapshots_cli.py``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import cli
from tests.support.embedded import SNAPSHOT_RUN, crashed_run

pytestmark = pytest.mark.slow  # each runs `parkway snapshots` as a process


def parkway(*args: str, state: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``parkway snapshots ARGS`` on ``state``, of run ``snaps`` unless ``env`` says otherwise."""
    variables = {"PARKWAY_STATE_DIR": str(state), "PARKWAY_RUN": SNAPSHOT_RUN["run"], **env}
    return cli.parkway("snapshots", *args, timeout=60, **variables)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    state = tmp_path_factory.mktemp("pristine")
    asyncio.run(crashed_run(state))
    return state


@pytest.fixture
def state(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "state")
    return tmp_path / "state"


def manifests(state: Path) -> dict[str, dict[str, Any]]:
    run_dir = state / "snapshots" / SNAPSHOT_RUN["run"]
    return {p.name: json.loads((p / "manifest.json").read_text()) for p in sorted(run_dir.glob("snapshot_*"))}


def test_list_prints_what_the_manifests_hold(state: Path) -> None:
    result = parkway("list", "--json", state=state)
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    on_disk = manifests(state)
    assert [s["name"] for s in listed["snapshots"]] == list(on_disk) == ["snapshot_1", "snapshot_2"]
    for row in listed["snapshots"]:
        manifest = on_disk[row["name"]]
        assert row["checkpoint_id"] == manifest["checkpoint_id"]
        assert row["trainer_step"] == manifest["trainer"]["step"]
        assert row["rollouts_saved"] == len(manifest["episodes"]) > 0
        assert row["created_at"] == manifest["created_at"]
        assert row["verifies"] is True
    assert listed["restore"]["snapshot"] == "snapshot_2" and listed["completed"] is False

    table = parkway("list", state=state)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == f"run 'snaps' in {state / 'snapshots' / 'snaps'}: 2 snapshots"
    assert lines[1].split() == [
        "SNAPSHOT",
        "CHECKPOINT",
        "TRAINER",
        "STEP",
        "ROLLOUTS",
        "SIZE",
        "AGE",
        "NOTE",
    ]
    for line, (name, manifest) in zip(lines[2:4], on_disk.items(), strict=True):
        cells = line.split()
        if name == "snapshot_2":
            assert cells.pop(0) == "*"  # what a restore starts from
        assert cells[:4] == [name, manifest["checkpoint_id"], "0", str(len(manifest["episodes"]))]
    assert "restore: a restore starts from snapshot_2 (*)" in lines


def test_show_by_checkpoint_id(state: Path) -> None:
    manifest = manifests(state)["snapshot_1"]
    result = parkway("show", manifest["checkpoint_id"], "--json", state=state)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["name"] == "snapshot_1" and shown["verifies"] and shown["problems"] == []
    assert shown["episodes"] == manifest["episodes"]
    assert shown["config_fingerprint"] == manifest["config_fingerprint"]
    assert shown["topology_fingerprint"] == manifest["topology_fingerprint"]
    assert shown["replicas"] == manifest["replicas"] == {"agent": 2, "policy": 1, "resources": 2, "tq": 1}
    files = {f["path"]: who for who, group in shown["participants"].items() for f in group}
    assert files == {
        e["path"]: (
            "controller/0"
            if e["path"] == "ledger.msgpack"
            else "tq/0"
            if e["path"].startswith("tq/")
            else "/".join(e["path"].split("/")[1:3])
        )
        for e in manifest["files"]
    }
    assert set(shown["participants"]) >= {"agent/0", "agent/1", "policy/0", "tq/0", "controller/0"}

    text = parkway("show", "snapshot_1", state=state)
    assert text.returncode == 0, text.stderr
    assert f"checkpoint id         {manifest['checkpoint_id']}" in text.stdout.splitlines()
    assert f"episodes saved ({len(manifest['episodes'])}): " in text.stdout
    assert "replicas              agent=2 policy=1 resources=2 tq=1" in text.stdout.splitlines()


def test_verify_says_exactly_what_is_wrong(state: Path) -> None:
    ok = parkway("verify", state=state)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "2 of 2 snapshot(s) verify"

    snapshot = state / "snapshots" / "snaps" / "snapshot_2"
    ledger = snapshot / "ledger.msgpack"
    data = bytearray(ledger.read_bytes())
    data[len(data) // 2] ^= 0x04
    ledger.write_bytes(bytes(data))
    rollouts = snapshot / "participants" / "agent" / "1" / "rollouts.msgpack"
    size = rollouts.stat().st_size
    rollouts.write_bytes(rollouts.read_bytes()[:-7])
    manifest = manifests(state)["snapshot_2"]
    [listed] = [e["sha256"] for e in manifest["files"] if e["path"] == "ledger.msgpack"]
    actual = hashlib.sha256(data).hexdigest()

    bad = parkway("verify", state=state)
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout.splitlines()[1:] == [
        f"snapshot_2: participants/agent/1/rollouts.msgpack is {size - 7} bytes, manifest says {size} (truncated)",
        f"snapshot_2: ledger.msgpack does not match its sha256: the manifest says {listed[:16]}, "
        f"the file hashes to {actual[:16]}",
        "1 of 2 snapshot(s) verify; 1 do not",
    ]
    assert bad.stdout.splitlines()[0].startswith("snapshot_1: ok")

    only_good = parkway("verify", "snapshot_1", "--json", state=state)
    assert only_good.returncode == 0 and json.loads(only_good.stdout)["ok"] is True
    as_json = json.loads(parkway("verify", "2", "--json", state=state).stdout)
    assert [(p["kind"], p["file"]) for p in as_json["snapshots"][0]["problems"]] == [
        ("size", "participants/agent/1/rollouts.msgpack"),
        ("digest", "ledger.msgpack"),
    ]

    listed_now = json.loads(parkway("list", "--json", state=state).stdout)
    assert listed_now["restore"]["snapshot"] == "snapshot_1"  # the one before stays authoritative
    assert listed_now["snapshots"][1]["skip_reason"].startswith("does not verify: participants/agent/1/")


def test_a_configuration_of_other_work_restores_nothing(state: Path, tmp_path: Path) -> None:
    import yaml

    same, other = tmp_path / "same.yaml", tmp_path / "other.yaml"
    same.write_text(yaml.safe_dump(SNAPSHOT_RUN))
    other.write_text(yaml.safe_dump({**SNAPSHOT_RUN, "seed": 99}))
    env = {"PARKWAY_RUN": ""}  # the run comes from the configuration's run:
    assert (
        json.loads(parkway("list", "--config", str(same), "--json", state=state, **env).stdout)["restore"][
            "snapshot"
        ]
        == "snapshot_2"
    )
    result = parkway("list", "--config", str(other), state=state, **env)
    assert result.returncode == 0, result.stderr
    assert "restore: no snapshot fits: a start begins afresh" in result.stdout.splitlines()
    assert result.stdout.count("written under another configuration") == 2


def test_usage_errors_exit_2(state: Path) -> None:
    unknown = parkway("show", "snapshot_9", state=state)
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == (
        "parkway: snapshots: no snapshot 'snapshot_9' in run 'snaps' (snapshots: snapshot_1, snapshot_2)"
    )
    assert parkway("verify", "ck-nope", state=state).returncode == 2
    other_run = parkway("list", "--run", "nothere", state=state)
    assert other_run.returncode == 2
    assert other_run.stderr.strip() == (
        f"parkway: snapshots: no snapshots of run 'nothere' under {state / 'snapshots'} (runs there: snaps)"
    )
    assert parkway("frobnicate", state=state).returncode == 2  # argparse: no such action
