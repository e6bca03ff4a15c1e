"""What the controller itself writes into a snapshot, and its publication.

The ledger file at the cut; then the manifest, the fsync of every directory, the rename of
``tmp_<id>`` to ``snapshot_<seq>``, the fsync of the run directory, and the pruning to the newest k.
Each write has its named fault point (``capture_write``, ``publish_write``, ``publish_fsync:files``,
``publish_rename``, ``publish_fsync:parent``): a test or the chaos harness fails it as a full disk, an
I/O error or a crash would.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from parkway.actors.runtime.durable import write_durably
from parkway.actors.runtime.faults import FaultPoints
from parkway.actors.storage.files import fsync_dir, sha256_bytes
from parkway.actors.storage.runs import RunDirectory
from parkway.protocol.anchor import LedgerFile, encode_ledger_file
from parkway.protocol.layout import LEDGER, MANIFEST
from parkway.protocol.manifest import Manifest, ManifestFile, encode_manifest


def write_ledger_file(tmp: Path, record: LedgerFile, checkpoint_id: str, faults: FaultPoints) -> ManifestFile:
    """``ledger.msgpack`` under the snapshot's temporary directory, durable; its manifest entry."""
    data = encode_ledger_file(record)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / LEDGER
    write_durably(path, data, halfway=lambda: faults.reach("capture_write", path=path))
    return ManifestFile(
        path=LEDGER, sha256=sha256_bytes(data), size=len(data), records=1, checkpoint_id=checkpoint_id
    )


@dataclass(frozen=True)
class Publication:
    path: Path  # the published ``snapshot_<seq>`` directory
    bytes: int  # every file of the snapshot and its manifest


def publish(run: RunDirectory, tmp: Path, manifest: Manifest, faults: FaultPoints) -> Publication:
    """Write the manifest into ``tmp``, make everything under it durable, and rename it to its
    published name. A failed fsync of the run directory undoes the rename (it may not be durable), so
    the snapshot is aborted like any failure before it and the previous one stays authoritative."""
    manifest_path = tmp / MANIFEST
    text = encode_manifest(manifest).encode()
    written = write_durably(
        manifest_path, text, halfway=lambda: faults.reach("publish_write", path=manifest_path)
    )
    directories = {(tmp / entry.path).parent for entry in manifest.files} | {tmp}
    for directory in sorted(directories, key=lambda p: -len(p.parts)):  # the deepest first
        faults.reach("publish_fsync", "files", path=directory)
        fsync_dir(directory)
    final = run.snapshot(manifest.seq)
    faults.reach("publish_rename", path=tmp)
    os.rename(tmp, final)
    try:
        faults.reach("publish_fsync", "parent", path=run.path)
        fsync_dir(run.path)
    except OSError:
        os.rename(final, tmp)
        raise
    return Publication(path=final, bytes=written + sum(entry.size for entry in manifest.files))


def prune(run: RunDirectory, keep_latest_k: int) -> None:
    """Delete every snapshot but the newest ``keep_latest_k``."""
    for _, path in run.snapshots()[:-keep_latest_k]:
        shutil.rmtree(path, ignore_errors=True)
