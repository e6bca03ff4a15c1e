"""Snapshots write what changed since the one before (docs/snapshots.md#incremental-writes): packs of
records that did not change are hard-linked from the newest published snapshot, every snapshot still
verifies on its own once the ones before it are pruned, and a run restored from such a snapshot ends
with the transcripts of a run that never crashed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from parkway.actors.storage.select import verify_snapshot

from tests.support.embedded import SNAPSHOT_RUN, embedded_run

# Many snapshots over rollouts of several turns each: between two of them most rows stay as they were.
RUN = {**SNAPSHOT_RUN, "keep_latest_k": 2}


@pytest.mark.asyncio
async def test_snapshots_link_what_did_not_change_and_restore_from_it(tmp_path: Path) -> None:
    from parkway.actors.roles.controller.controller import SimulatedCrash

    slower = {**RUN, "policy": {**RUN["policy"], "per_token_delay_s": 0.003}}
    with pytest.raises(SimulatedCrash):
        await embedded_run(slower, tmp_path / "crashed", stop_after=6)
    run_dir = tmp_path / "crashed" / "snapshots" / RUN["run"]
    kept = sorted(run_dir.glob("snapshot_*"), key=lambda p: int(p.name.split("_")[1]))
    assert [p.name for p in kept] == ["snapshot_5", "snapshot_6"]  # the older four pruned

    newest = verify_snapshot(kept[-1])  # complete on its own: every file there, every digest right
    linked = [f for f in newest.files if f.linked]
    written = [f for f in newest.files if not f.linked]
    assert linked, "the newest snapshot linked none of the packs of the one before"
    assert any(f.path.startswith("tq/staging.packs/") for f in linked)  # TQ's rows never change
    for f in linked:  # the same file as snapshot_5's: a hard link, no data written
        assert os.stat(kept[-1] / f.path).st_ino == os.stat(kept[0] / f.path).st_ino
    assert sum(f.size for f in written) < sum(f.size for f in newest.files)

    # Restored from snapshot_6 (its links outlive snapshot_5), the run ends as an uncrashed one does.
    restored = await embedded_run(RUN, tmp_path / "crashed")
    assert restored.restores == 1 and restored.rollouts_restored > 0
    uncrashed = await embedded_run(RUN, tmp_path / "uncrashed", snapshots=False)
    assert restored.transcripts_sha256 == uncrashed.transcripts_sha256
    assert restored.rollouts_sealed == uncrashed.rollouts_sealed > 0


@pytest.mark.asyncio
async def test_a_run_reports_what_its_snapshots_wrote(tmp_path: Path) -> None:
    summary = await embedded_run({**RUN, "policy": {**RUN["policy"], "per_token_delay_s": 0.003}}, tmp_path)
    assert summary.snapshots_published >= 3
    # The first snapshot writes everything; the later ones what changed since the one before.
    assert 0 < summary.snapshot_bytes_written["p50"] < summary.snapshot_bytes["p50"]


def test_a_save_rehashes_a_linked_pack_only_when_it_is_not_the_base_s_file(tmp_path: Path) -> None:
    from parkway.actors.roles.controller.snapshot_files import check_files
    from parkway.protocol.manifest import ManifestFile

    base, tmp = tmp_path / "snapshot_1", tmp_path / "tmp_x"
    (base / "p").mkdir(parents=True)
    (tmp / "p").mkdir(parents=True)
    (base / "p" / "a.pack").write_bytes(b"rows")
    (tmp / "tq").mkdir()
    (tmp / "tq" / "staging.msgpack").write_bytes(b"\x90")  # no rows (the staging check reads it)
    os.link(base / "p" / "a.pack", tmp / "p" / "a.pack")
    wrong = ManifestFile(path="p/a.pack", sha256="0" * 64, size=4, records=1, checkpoint_id="x", linked=True)
    # The very file the snapshot before was checked with: its size is enough (no second hash).
    assert check_files(tmp, [wrong], base) is None
    # A copy is another file: hashed, and a wrong digest is found.
    (tmp / "p" / "a.pack").unlink()
    (tmp / "p" / "a.pack").write_bytes(b"rows")
    problem = check_files(tmp, [wrong], base)
    assert problem is not None and "does not match its digest" in problem[0]
