"""``check_snapshot`` and ``inventory`` on real snapshots: written by an embedded run, then damaged one
way at a time. Each damage is reported exactly (its kind, its file, what is wrong), and all of them are
reported together."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from parkway.actors.roles.controller.fingerprints import config_fingerprint
from parkway.actors.run.config import from_dict
from parkway.actors.storage.checks import Kind, Problem, check_snapshot
from parkway.actors.storage.inventory import inventory
from parkway.actors.storage.select import SnapshotInvalid, select_snapshot, verify_snapshot

from tests.support.embedded import SNAPSHOT_RUN, crashed_run


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One crashed run's directory for the whole module; each test damages its own copy."""
    return asyncio.run(crashed_run(tmp_path_factory.mktemp("pristine")))


@pytest.fixture
def run_dir(pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "snapshots" / pristine.name
    shutil.copytree(pristine, copy)
    return copy


@pytest.fixture
def snapshot(run_dir: Path) -> Path:
    return sorted(run_dir.glob("snapshot_*"))[-1]


def manifest_of(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "manifest.json").read_text())


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))


def rewrite_manifest(directory: Path, **changes: Any) -> None:
    write_manifest(directory, {**manifest_of(directory), **changes})


def entry(directory: Path, path: str) -> dict[str, Any]:
    [found] = [e for e in manifest_of(directory)["files"] if e["path"] == path]
    return found


AGENT_FILE = "participants/agent/0/rollouts.msgpack"


def test_snapshots_a_run_wrote_verify(run_dir: Path) -> None:
    snapshots = sorted(run_dir.glob("snapshot_*"))
    assert [p.name for p in snapshots] == ["snapshot_1", "snapshot_2"]
    for directory in snapshots:
        assert check_snapshot(directory) == []
        assert json.loads(msgspec.json.encode(verify_snapshot(directory))) == manifest_of(directory)


def test_a_flipped_bit(snapshot: Path) -> None:
    path = snapshot / AGENT_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    listed = entry(snapshot, AGENT_FILE)["sha256"]
    actual = hashlib.sha256(data).hexdigest()
    assert check_snapshot(snapshot) == [
        Problem(
            "snapshot_2",
            AGENT_FILE,
            Kind.DIGEST,
            f"does not match its sha256: the manifest says {listed[:16]}, the file hashes to {actual[:16]}",
        )
    ]
    with pytest.raises(SnapshotInvalid) as raised:
        verify_snapshot(snapshot)
    assert str(raised.value) == (
        f"snapshot_2: {AGENT_FILE} does not match its sha256: the manifest says {listed[:16]}, "
        f"the file hashes to {actual[:16]}"
    )


def test_a_truncated_file(snapshot: Path) -> None:
    [path] = (snapshot / "tq" / "staging.packs").glob("*.pack")  # where TQ's rows are (not the index)
    relative = path.relative_to(snapshot).as_posix()
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:100])
    # The one problem: the index that names the pack is not read through it.
    assert check_snapshot(snapshot) == [
        Problem("snapshot_2", relative, Kind.SIZE, f"is 100 bytes, manifest says {size} (truncated)")
    ]
    with pytest.raises(SnapshotInvalid, match=rf"^snapshot_2: {relative} is 100 bytes, manifest says"):
        verify_snapshot(snapshot)


def test_a_missing_file(snapshot: Path) -> None:
    (snapshot / "ledger.msgpack").unlink()
    assert check_snapshot(snapshot) == [Problem("snapshot_2", "ledger.msgpack", Kind.MISSING, "is missing")]
    with pytest.raises(SnapshotInvalid, match=r"^snapshot_2: ledger.msgpack is missing$"):
        verify_snapshot(snapshot)


def test_a_stray_file(snapshot: Path) -> None:
    (snapshot / "participants" / "agent" / "0" / "notes.txt").write_text("hello")
    assert check_snapshot(snapshot) == [
        Problem(
            "snapshot_2",
            "participants/agent/0/notes.txt",
            Kind.STRAY,
            "is on disk (5 bytes) but not in the manifest",
        )
    ]
    # The manifest's file list is exactly what is on disk: a restore passes it over like a corrupt one.
    with pytest.raises(SnapshotInvalid, match=r"^snapshot_2: participants/agent/0/notes.txt is on disk"):
        verify_snapshot(snapshot)


def test_a_manifest_from_another_run(snapshot: Path) -> None:
    rewrite_manifest(snapshot, run="elsewhere")
    assert check_snapshot(snapshot) == [
        Problem(
            "snapshot_2",
            "manifest.json",
            Kind.OTHER_RUN,
            "names run 'elsewhere', but lies in the directory of run 'snaps': a manifest from another run",
        )
    ]


def test_a_snapshot_copied_in_from_elsewhere(run_dir: Path) -> None:
    shutil.copytree(run_dir / "snapshot_1", run_dir / "snapshot_7")
    assert check_snapshot(run_dir / "snapshot_7") == [
        Problem("snapshot_7", "manifest.json", Kind.SEQUENCE, "says seq 1, but its directory is snapshot_7")
    ]


def test_a_manifest_that_is_not_json(snapshot: Path) -> None:
    (snapshot / "manifest.json").write_text('{"schema": 1,')
    assert check_snapshot(snapshot) == [
        Problem(
            "snapshot_2",
            "manifest.json",
            Kind.NOT_JSON,
            "is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 14 (char 13)",
        )
    ]
    with pytest.raises(SnapshotInvalid, match=r"^snapshot_2: manifest.json is not valid JSON: "):
        verify_snapshot(snapshot)


def test_a_missing_manifest(snapshot: Path) -> None:
    (snapshot / "manifest.json").unlink()
    assert check_snapshot(snapshot) == [Problem("snapshot_2", "manifest.json", Kind.UNREADABLE, "is missing")]


def test_another_schema_version(snapshot: Path) -> None:
    rewrite_manifest(snapshot, schema=2)
    assert check_snapshot(snapshot) == [
        Problem("snapshot_2", "manifest.json", Kind.SCHEMA, "has schema 2, expected 1")
    ]


def test_fields_of_the_wrong_shape(snapshot: Path) -> None:
    manifest = manifest_of(snapshot)
    manifest["files"][1]["size"] = "big"
    del manifest["trainer"]
    write_manifest(snapshot, manifest)
    assert check_snapshot(snapshot) == [
        Problem(
            "snapshot_2",
            "manifest.json",
            Kind.SCHEMA,
            "does not fit its schema: Object missing required field `trainer`",
        ),
        Problem(
            "snapshot_2",
            "manifest.json",
            Kind.SCHEMA,
            "does not fit its schema: Expected `int`, got `str` - at `$.files[1].size`",
        ),
    ]
    with pytest.raises(SnapshotInvalid, match="missing required field `trainer`"):
        verify_snapshot(snapshot)  # before, a KeyError escaped and ended the restore


def test_a_listed_path_outside_the_snapshot(snapshot: Path) -> None:
    manifest = manifest_of(snapshot)
    manifest["files"].append({**manifest["files"][0], "path": "../snapshot_1/ledger.msgpack"})
    write_manifest(snapshot, manifest)
    assert check_snapshot(snapshot) == [
        Problem(
            "snapshot_2",
            "../snapshot_1/ledger.msgpack",
            Kind.SCHEMA,
            "is listed, but is not a path inside the snapshot",
        )
    ]


def test_a_file_written_under_another_checkpoint(snapshot: Path) -> None:
    manifest = manifest_of(snapshot)
    [agent] = [e for e in manifest["files"] if e["path"] == AGENT_FILE]
    agent["checkpoint_id"] = "ck-older"
    write_manifest(snapshot, manifest)
    assert check_snapshot(snapshot) == [
        Problem(
            "snapshot_2",
            AGENT_FILE,
            Kind.CHECKPOINT,
            f"was written under checkpoint ck-older, the manifest's is {manifest['checkpoint_id']}",
        )
    ]


def test_a_wrong_record_count(snapshot: Path) -> None:
    manifest = manifest_of(snapshot)
    [agent] = [e for e in manifest["files"] if e["path"] == AGENT_FILE]
    records = agent["records"]
    agent["records"] = records + 1
    write_manifest(snapshot, manifest)
    assert check_snapshot(snapshot) == [
        Problem(
            "snapshot_2", AGENT_FILE, Kind.RECORDS, f"holds {records} records, manifest says {records + 1}"
        )
    ]


def test_episodes_the_ledger_did_not_dispatch(snapshot: Path) -> None:
    manifest = manifest_of(snapshot)
    dropped = manifest["episodes"].pop(0)
    write_manifest(snapshot, manifest)
    assert check_snapshot(snapshot) == [
        Problem(
            "snapshot_2",
            "ledger.msgpack",
            Kind.LEDGER,
            f"disagrees with the manifest's episodes: dispatched but not saved: {dropped[0]}@{dropped[1]}",
        )
    ]


def test_every_problem_is_reported_not_just_the_first(snapshot: Path) -> None:
    (snapshot / "ledger.msgpack").write_bytes(b"\x00" + (snapshot / "ledger.msgpack").read_bytes()[1:])
    staging = snapshot / "tq" / "staging.msgpack"
    staging.write_bytes(staging.read_bytes()[:-1])
    (snapshot / "tq" / "lineage.msgpack").unlink()
    (snapshot / "stray.bin").write_bytes(b"x")
    rewrite_manifest(snapshot, run="elsewhere")
    found = {(p.kind, p.file) for p in check_snapshot(snapshot)}
    assert found == {
        (Kind.OTHER_RUN, "manifest.json"),
        (Kind.DIGEST, "ledger.msgpack"),
        (Kind.SIZE, "tq/staging.msgpack"),
        (Kind.MISSING, "tq/lineage.msgpack"),
        (Kind.STRAY, "stray.bin"),
    }
    with pytest.raises(SnapshotInvalid, match=r"^snapshot_2: manifest.json names run 'elsewhere'"):
        verify_snapshot(snapshot)  # the manifest's run first, as the check lists it


def test_the_inventory_reads_what_the_manifests_hold(run_dir: Path) -> None:
    found = inventory(run_dir)
    assert [s.name for s in found.snapshots] == ["snapshot_1", "snapshot_2"]
    for info in found.snapshots:
        manifest = manifest_of(info.path)
        assert info.checkpoint_id == manifest["checkpoint_id"]
        assert info.seq == manifest["seq"]
        assert info.trainer_step == manifest["trainer"]["step"]
        assert info.rollouts_saved == len(manifest["episodes"]) > 0
        assert info.created_at == manifest["created_at"]
        assert info.size_bytes == sum(p.stat().st_size for p in info.path.rglob("*") if p.is_file())
        assert info.problem is None
    assert [s.restore for s in found.snapshots] == [False, True]
    assert found.completed_at is None and found.find(found.snapshots[0].checkpoint_id) is found.snapshots[0]


def test_the_inventory_picks_what_a_restore_picks(run_dir: Path) -> None:
    fingerprint = config_fingerprint(from_dict(SNAPSHOT_RUN))
    newest = run_dir / "snapshot_2"
    (newest / "ledger.msgpack").write_bytes(b"\x00" + (newest / "ledger.msgpack").read_bytes()[1:])
    picked, _ = select_snapshot(run_dir, config_fingerprint=fingerprint)  # type: ignore[misc]
    found = inventory(run_dir, config_fingerprint=fingerprint)
    assert found.selected is not None and found.selected.path == picked == run_dir / "snapshot_1"
    assert found.snapshots[1].skip_reason.startswith(
        "does not verify: ledger.msgpack does not match its sha256"
    )

    other = config_fingerprint(from_dict({**SNAPSHOT_RUN, "seed": 99}))
    assert select_snapshot(run_dir, config_fingerprint=other) is None
    found = inventory(run_dir, config_fingerprint=other)
    assert found.selected is None and found.restore_detail == "no snapshot fits: a start begins afresh"
    assert found.snapshots[0].skip_reason == "written under another configuration"


def test_a_completed_run_restores_nothing(run_dir: Path) -> None:
    (run_dir / "COMPLETED").write_text("1795957779.5\n")
    found = inventory(run_dir)
    assert found.selected is None and found.completed_at == 1795957779.5
    assert "marked completed" in found.restore_detail


# -- symlinks and the exact file list: what ``snapshots verify`` says is what a restore picks ---------


def test_a_directory_symlink_fails_the_check_and_the_restore_passes_it_over(
    run_dir: Path, tmp_path: Path
) -> None:
    newest = run_dir / "snapshot_2"
    outside = tmp_path / "outside_participants"
    shutil.copytree(newest / "participants", outside)  # an identical copy: every digest would match
    shutil.rmtree(newest / "participants")
    (newest / "participants").symlink_to(outside, target_is_directory=True)
    problems = check_snapshot(newest)
    assert Problem("snapshot_2", "participants", Kind.SYMLINK, f"is a symlink (to {outside})") in problems
    with pytest.raises(SnapshotInvalid, match=r"^snapshot_2: participants is a symlink"):
        verify_snapshot(newest)
    fingerprint = config_fingerprint(from_dict(SNAPSHOT_RUN))
    picked, _ = select_snapshot(run_dir, config_fingerprint=fingerprint)  # type: ignore[misc]
    found = inventory(run_dir, config_fingerprint=fingerprint)
    assert picked == run_dir / "snapshot_1"
    assert found.selected is not None and found.selected.path == picked


def test_a_file_symlink_is_not_read_through(snapshot: Path, tmp_path: Path) -> None:
    outside = tmp_path / "ledger_copy.msgpack"
    shutil.copyfile(snapshot / "ledger.msgpack", outside)
    (snapshot / "ledger.msgpack").unlink()
    (snapshot / "ledger.msgpack").symlink_to(outside)
    assert check_snapshot(snapshot) == [
        Problem("snapshot_2", "ledger.msgpack", Kind.SYMLINK, f"is a symlink (to {outside})")
    ]
    with pytest.raises(SnapshotInvalid, match=r"^snapshot_2: ledger.msgpack is a symlink"):
        verify_snapshot(snapshot)


def test_a_snapshot_directory_that_is_a_symlink_fails(run_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere_snapshot"
    shutil.move(run_dir / "snapshot_2", elsewhere)
    (run_dir / "snapshot_2").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(SnapshotInvalid, match=r"^snapshot_2: \. is a symlink"):
        verify_snapshot(run_dir / "snapshot_2")
