"""Every problem of one snapshot on disk, not just the first.

``check_snapshot`` finds them all: a symlink anywhere in the snapshot (file or directory, or the
snapshot directory itself: nothing is read through one); the manifest cannot be read, is not JSON or
does not fit its schema; a listed file is missing, has another size (truncated) or another sha256
(flipped bits); a file on disk is not listed; the manifest names another run, another sequence number,
or lists a file written under another checkpoint id; a file holds another number of records than
listed; the ledger disagrees with the saved episodes; a saved turn references a staging row TQ did not
capture. It is the one check: ``parkway snapshots verify``, ``parkway snapshots list`` and the
restore's choice (``storage.select.verify_snapshot``) all call it, so a snapshot verify calls ok is
one a restore can start from, and one that fails is passed over by both.

Read-only: nothing here writes, renames or deletes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import msgspec
from parkway.actors.runtime.packs import UnreadablePacks, packs_dir, read_records
from parkway.actors.storage.files import files_on_disk, sha256_file
from parkway.protocol.anchor import decode_ledger_file
from parkway.protocol.ids import is_valid_checkpoint_id, staging_key
from parkway.protocol.layout import (
    AGENT_ROLLOUTS,
    LEDGER,
    MANIFEST,
    PARTICIPANTS_DIR,
    RECORDS_SUFFIX,
    TQ_DIR,
    TQ_STAGING,
    snapshot_dir_name,
)
from parkway.protocol.ledger import Ledger
from parkway.protocol.manifest import SCHEMA, ManifestFile, ManifestHead
from parkway.protocol.messages import StagingRow
from parkway.protocol.snapshot import episode_mismatch
from parkway.protocol.transcript import SavedRollout


class Kind(StrEnum):
    """What is wrong, one word; ``Problem.detail`` says exactly how."""

    UNREADABLE = "unreadable"  # the manifest is missing or cannot be read
    NOT_JSON = "not_json"  # the manifest is not JSON text
    SCHEMA = "schema"  # another schema version, a field of the wrong shape, a path outside the snapshot
    MISSING = "missing"  # a listed file is not on disk (or a file a restore reads is not listed)
    SIZE = "size"  # a listed file has another size than listed (truncated, or appended to)
    DIGEST = "digest"  # a listed file has its size but another sha256 (flipped bits)
    STRAY = "stray"  # a file on disk that the manifest does not list
    OTHER_RUN = "other_run"  # the manifest names another run than the directory it lies in
    SEQUENCE = "sequence"  # the manifest's sequence number is not its directory's
    CHECKPOINT = "checkpoint"  # a listed file was written under another checkpoint id than the manifest's
    RECORDS = "records"  # a file holds another number of records than listed, or is not MessagePack
    LEDGER = "ledger"  # the ledger cannot be loaded, or disagrees with the saved episodes
    STAGING = "staging"  # saved turns reference staging rows that TQ's capture does not hold
    SYMLINK = "symlink"  # a symlink in the snapshot (or the snapshot directory is one): never read through


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with one file of one snapshot. ``message``: ``<snapshot>: <file> <detail>``."""

    snapshot: str
    file: str
    kind: Kind
    detail: str

    @property
    def message(self) -> str:
        return f"{self.snapshot}: {self.file} {self.detail}"

    def to_json(self) -> dict[str, str]:
        return {
            "snapshot": self.snapshot,
            "file": self.file,
            "kind": self.kind.value,
            "detail": self.detail,
            "message": self.message,
        }


def _validation(exc: msgspec.ValidationError, at: str) -> str:
    return str(exc).replace("`$", f"`{at}")


def _inside(directory: Path, relative: str) -> bool:
    if not relative or Path(relative).is_absolute():
        return False
    return os.path.normpath(directory / relative).startswith(os.path.normpath(directory) + os.sep)


def read_manifest(directory: Path) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The manifest as JSON, or None with the problem that stops reading it."""
    name, path = directory.name, directory / MANIFEST

    def problem(kind: Kind, detail: str) -> tuple[None, list[Problem]]:
        return None, [Problem(name, MANIFEST, kind, detail)]

    try:
        text = path.read_bytes().decode()
    except FileNotFoundError:
        return problem(Kind.UNREADABLE, "is missing")
    except OSError as exc:
        return problem(Kind.UNREADABLE, f"cannot be read: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        return problem(Kind.NOT_JSON, f"is not UTF-8 text: {exc}")
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        return problem(Kind.NOT_JSON, f"is not valid JSON: {exc}")
    if not isinstance(manifest, dict):
        return problem(Kind.SCHEMA, f"holds a JSON {type(manifest).__name__}, not an object")
    if manifest.get("schema") != SCHEMA:
        return problem(Kind.SCHEMA, f"has schema {manifest.get('schema')!r}, expected {SCHEMA}")
    return manifest, []


def symlinks_in(directory: Path) -> dict[str, str]:
    """Every symlink in the snapshot ``directory`` (``.`` when it is one itself), relative path to
    where it points. Nothing below a directory symlink is looked at: it is not the snapshot's."""
    if directory.is_symlink():
        return {".": os.readlink(directory)}
    found: dict[str, str] = {}
    for parent, dirs, names in os.walk(directory):  # (os.walk never descends into a directory link)
        for entry in sorted(dirs + names):
            path = Path(parent) / entry
            if path.is_symlink():
                found[path.relative_to(directory).as_posix()] = os.readlink(path)
    return found


def _under_symlink(relative: str, links: dict[str, str]) -> bool:
    parts = Path(relative).parts
    return any("/".join(parts[: i + 1]) in links for i in range(len(parts)))


def check_snapshot(directory: Path) -> list[Problem]:
    """Every problem of the snapshot in ``directory``; empty when it verifies (and a restore may
    start from it, the configuration permitting: ``storage.select``)."""
    name = directory.name
    links = symlinks_in(directory)
    problems = [
        Problem(name, relative, Kind.SYMLINK, f"is a symlink (to {target})")
        for relative, target in sorted(links.items())
    ]
    if "." in links or _under_symlink(MANIFEST, links):
        return problems
    manifest, unreadable = read_manifest(directory)
    problems += unreadable
    if manifest is None:
        return problems

    head: ManifestHead | None = None
    try:
        head = msgspec.convert({k: v for k, v in manifest.items() if k != "files"}, ManifestHead)
    except msgspec.ValidationError as exc:
        problems.append(Problem(name, MANIFEST, Kind.SCHEMA, f"does not fit its schema: {exc}"))
    if head is not None and not is_valid_checkpoint_id(head.checkpoint_id):
        problems.append(
            Problem(
                name,
                MANIFEST,
                Kind.SCHEMA,
                f"has checkpoint id {head.checkpoint_id!r}: not a valid id",
            )
        )

    if head is not None and head.run != directory.parent.name:
        problems.append(
            Problem(
                name,
                MANIFEST,
                Kind.OTHER_RUN,
                f"names run {head.run!r}, but lies in the directory of run {directory.parent.name!r}: "
                "a manifest from another run",
            )
        )
    if head is not None and name != snapshot_dir_name(head.seq):
        problems.append(
            Problem(name, MANIFEST, Kind.SEQUENCE, f"says seq {head.seq}, but its directory is {name}")
        )

    raw_files = manifest.get("files")
    entries: list[ManifestFile] = []
    listed: set[str] = set()  # every path the manifest names, well formed or not (none of them is stray)
    if not isinstance(raw_files, list):
        problems.append(
            Problem(
                name,
                MANIFEST,
                Kind.SCHEMA,
                "does not fit its schema: "
                + (
                    "Object missing required field `files`"
                    if raw_files is None
                    else "`files` is not an array"
                ),
            )
        )
        raw_files = []
    for i, raw in enumerate(raw_files):
        if isinstance(raw, dict) and isinstance(raw.get("path"), str):
            listed.add(raw["path"])
        try:
            entry = msgspec.convert(raw, ManifestFile)
        except msgspec.ValidationError as exc:
            problems.append(
                Problem(
                    name,
                    MANIFEST,
                    Kind.SCHEMA,
                    f"does not fit its schema: {_validation(exc, f'$.files[{i}]')}",
                )
            )
            continue
        if not _inside(directory, entry.path):
            problems.append(
                Problem(name, entry.path, Kind.SCHEMA, "is listed, but is not a path inside the snapshot")
            )
        elif entry.path == MANIFEST or any(e.path == entry.path for e in entries):
            problems.append(Problem(name, entry.path, Kind.SCHEMA, "is listed twice"))
        else:
            entries.append(entry)
            if head is not None and entry.checkpoint_id != head.checkpoint_id:
                problems.append(
                    Problem(
                        name,
                        entry.path,
                        Kind.CHECKPOINT,
                        f"was written under checkpoint {entry.checkpoint_id}, "
                        f"the manifest's is {head.checkpoint_id}",
                    )
                )

    intact: set[str] = set()  # listed files that are there with their size and digest
    for entry in entries:
        path = directory / entry.path
        if _under_symlink(entry.path, links):
            continue  # (the symlink is the problem reported; nothing is read through it)
        if not path.exists():
            problems.append(Problem(name, entry.path, Kind.MISSING, "is missing"))
            continue
        if not path.is_file():
            problems.append(Problem(name, entry.path, Kind.MISSING, "is not a regular file"))
            continue
        size = path.stat().st_size
        if size != entry.size:
            how = "truncated" if size < entry.size else "longer than written"
            problems.append(
                Problem(name, entry.path, Kind.SIZE, f"is {size} bytes, manifest says {entry.size} ({how})")
            )
            continue
        digest = sha256_file(path)
        if digest != entry.sha256:
            problems.append(
                Problem(
                    name,
                    entry.path,
                    Kind.DIGEST,
                    f"does not match its sha256: the manifest says {entry.sha256[:16]}, "
                    f"the file hashes to {digest[:16]}",
                )
            )
            continue
        intact.add(entry.path)
    if LEDGER not in listed:
        problems.append(
            Problem(name, LEDGER, Kind.MISSING, "is not listed in the manifest (a restore reads it)")
        )
    if LEDGER in intact:
        problems += _check_ledger(directory, head)

    on_disk = files_on_disk(directory)
    for stray in sorted(set(on_disk) - listed - {MANIFEST, LEDGER}):
        problems.append(
            Problem(name, stray, Kind.STRAY, f"is on disk ({on_disk[stray]} bytes) but not in the manifest")
        )

    decoded: dict[str, Any] = {}
    for entry in entries:
        if entry.path not in intact or not entry.path.endswith(RECORDS_SUFFIX) or entry.path == LEDGER:
            continue  # (the ledger was read above)
        packs = packs_dir(Path(entry.path)).as_posix() + "/"
        if any(e.path.startswith(packs) and e.path not in intact for e in entries):
            continue  # a pack of this index is reported above: the index is not read through it
        try:
            decoded[entry.path] = read_records(directory / entry.path)  # plain, or an index and packs
        except msgspec.DecodeError as exc:
            problems.append(Problem(name, entry.path, Kind.RECORDS, f"is not valid MessagePack: {exc}"))
            continue
        except (msgspec.ValidationError, UnreadablePacks) as exc:
            problems.append(Problem(name, entry.path, Kind.RECORDS, f"holds no list of records: {exc}"))
            continue
        except OSError as exc:
            problems.append(Problem(name, entry.path, Kind.RECORDS, f"cannot be read: {exc.strerror or exc}"))
            continue
        count = len(decoded[entry.path])
        if count != entry.records:
            problems.append(
                Problem(
                    name, entry.path, Kind.RECORDS, f"holds {count} records, manifest says {entry.records}"
                )
            )

    staging = staging_files(directory)
    if any(path in decoded for path in staging):
        try:
            missing = missing_staging_keys(directory, only=intact)
        except Undecodable as exc:
            problems.append(Problem(name, exc.path, Kind.RECORDS, f"does not decode: {exc.reason}"))
            missing = {}
        for rollouts_file, keys in missing.items():
            shown = ", ".join(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")
            problems.append(
                Problem(
                    name,
                    rollouts_file,
                    Kind.STAGING,
                    f"references staging rows TQ's {TQ_STAGING} does not hold: {shown}"
                    if staging == [TQ_STAGING]
                    else f"references staging rows no TQ shard's staging.msgpack holds: {shown}",
                )
            )
    return problems


def _check_ledger(directory: Path, head: ManifestHead | None) -> list[Problem]:
    """The ledger file decodes, its ledger loads, and its dispatched attempts are the saved episodes
    (what a restore checks). Without a manifest head to compare with, only that it is MessagePack."""
    name = directory.name

    def problem(detail: str) -> list[Problem]:
        return [Problem(name, LEDGER, Kind.LEDGER, detail)]

    try:
        record = decode_ledger_file((directory / LEDGER).read_bytes())
    except msgspec.ValidationError as exc:
        return problem(f"cannot be loaded: ValidationError: {exc}") if head is not None else []
    except msgspec.DecodeError as exc:
        return problem(f"cannot be loaded: not MessagePack: {exc}")
    if head is None:
        return []
    try:
        ledger = Ledger.load(record.ledger)
    except (KeyError, TypeError, ValueError) as exc:  # msgspec's errors are ValueErrors
        return problem(f"cannot be loaded: {type(exc).__name__}: {exc}")
    restarts = head.restart_episodes()
    mismatch = episode_mismatch(head.saved_episodes() - restarts, ledger.dispatched() - restarts)
    if mismatch:
        return problem(f"disagrees with the manifest's episodes: {mismatch}")
    return []


class Undecodable(Exception):
    """A snapshot file that does not decode as the records it should hold."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def staging_files(directory: Path) -> list[str]:
    """TQ's staging rows files in a snapshot: ``tq/staging.msgpack`` and, of a sharded TQ, each other
    shard's ``tq/<n>/staging.msgpack`` (relative paths)."""
    shards = sorted(
        (p for p in directory.glob(f"{TQ_DIR}/*/staging.msgpack") if p.parent.name.isdigit()),
        key=lambda p: int(p.parent.name),
    )
    return [TQ_STAGING, *(p.relative_to(directory).as_posix() for p in shards)]


def _decode(directory: Path, relative: str, kind: Any) -> Any:
    try:
        return read_records(directory / relative, kind)
    except (msgspec.DecodeError, msgspec.ValidationError, UnreadablePacks, OSError) as exc:
        raise Undecodable(relative, str(exc)) from None


class _StagingKey(msgspec.Struct, frozen=True):
    """A staging row read for its key alone (tokens and logprobs are skipped, never built)."""

    capture_key: str
    turn: int


class _ModelStepKey(msgspec.Struct, frozen=True):
    staging_key: str


class _RolloutKeys(msgspec.Struct, frozen=True):
    """A saved rollout read for the staging keys of its turns alone."""

    model: tuple[_ModelStepKey, ...]


def missing_staging_keys(
    directory: Path, *, only: set[str] | None = None, strict: bool = True
) -> dict[str, list[str]]:
    """Per agent rollouts file: the staging keys its saved turns reference that TQ's capture lacks.
    ``only``: the files to look at (all by default). ``strict``: decode the records whole, as their
    types (``snapshots verify``); otherwise read the keys alone, which is what a save's validation
    needs of files whose digests it has just checked. Raises ``Undecodable``."""
    staging_type: Any = StagingRow if strict else _StagingKey
    rollouts_type: Any = SavedRollout if strict else _RolloutKeys
    rows = [row for path in staging_files(directory) for row in _decode(directory, path, staging_type)]
    # A row whose key no builder makes (TQ stores what a hostile client sent) is no saved turn's row.
    captured = {staging_key(r.capture_key, r.turn) for r in rows if r.capture_key and r.turn >= 0}
    missing: dict[str, list[str]] = {}
    for rollouts in sorted((directory / PARTICIPANTS_DIR / "agent").glob(f"*/{AGENT_ROLLOUTS}")):
        relative = rollouts.relative_to(directory).as_posix()
        if only is not None and relative not in only:
            continue
        keys = [
            step.staging_key
            for saved in _decode(directory, relative, rollouts_type)
            for step in saved.model
            if step.staging_key not in captured
        ]
        if keys:
            missing[relative] = keys
    return missing
