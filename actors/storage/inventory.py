"""What is on disk under a snapshot root: the snapshots of a run, and every problem each one has.

Read-only: nothing here writes, renames or deletes. ``actors/roles/controller/snapshots.py`` writes the layout (see
its docstring) and restores from it; ``parkway snapshots list|show|verify`` prints what this module
finds.

``check_snapshot`` reports every problem of one snapshot, not just the first: the manifest cannot be
read, is not JSON or does not fit its schema; a listed file is missing, has another size (truncated) or
another sha256 (flipped bits); a file on disk is not listed; the manifest names another run, another
sequence number, or lists a file written under another checkpoint id; a file holds another number of
records than listed; the ledger disagrees with the saved episodes; a saved turn references a staging
row TQ did not capture. The checks a restore makes before it picks a snapshot (``verify_snapshot``) are
the subset ``deep=False``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import msgspec
from parkway.protocol.ids import is_valid_checkpoint_id

MANIFEST_SCHEMA = 1
LEDGER_FILE = "ledger.msgpack"
STAGING_FILE = "tq/staging.msgpack"


class Kind(StrEnum):
    """What is wrong, one word; ``Problem.detail`` says exactly how."""

    UNREADABLE = "unreadable"  # manifest.json is missing or cannot be read
    NOT_JSON = "not_json"  # manifest.json is not JSON text
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


# What a restore checks before it picks a snapshot (``verify_snapshot``): the manifest (of this run),
# the digests, and the ledger it loads (it is listed, it loads, it agrees with the saved episodes).
RESTORE_KINDS = frozenset(
    {
        Kind.UNREADABLE,
        Kind.NOT_JSON,
        Kind.SCHEMA,
        Kind.MISSING,
        Kind.SIZE,
        Kind.DIGEST,
        Kind.OTHER_RUN,
        Kind.LEDGER,
    }
)


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


# -- the manifest's schema --------------------------------------------------------------------------

Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
Count = Annotated[int, msgspec.Meta(ge=0)]


class ManifestFile(msgspec.Struct, frozen=True):
    path: str
    sha256: Sha256
    size: Count
    records: Count
    checkpoint_id: str


class TrainerAnchor(msgspec.Struct, frozen=True):
    step: Count
    policy_version: Count


class ManifestHead(msgspec.Struct, frozen=True):
    """Everything in a manifest but its file list."""

    schema: int
    checkpoint_id: str
    seq: Annotated[int, msgspec.Meta(ge=1)]
    run: str
    created_at: float
    trainer: TrainerAnchor
    config_fingerprint: Sha256
    topology_fingerprint: Sha256
    episodes: list[tuple[str, Count]]
    restarts: list[tuple[str, Count]]


# -- small readers ------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def list_snapshots(run_dir: Path) -> list[tuple[int, Path]]:
    """``(seq, path)`` of every ``snapshot_<seq>`` directory of a run, oldest first."""
    found = []
    for path in run_dir.glob("snapshot_*") if run_dir.is_dir() else ():
        suffix = path.name.removeprefix("snapshot_")
        if suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def trainer_steps(run_dir: Path) -> list[int]:
    """The steps of the trainer checkpoints under ``<run>/trainer/``, oldest first."""
    trainer = run_dir / "trainer"
    if not trainer.is_dir():
        return []
    return sorted(
        int(p.stem.removeprefix("step_"))
        for p in trainer.glob("step_*.msgpack")
        if p.stem.removeprefix("step_").isdigit()
    )


def newest_trainer_step(run_dir: Path) -> int | None:
    steps = trainer_steps(run_dir)
    return steps[-1] if steps else None


def skip_reason(manifest: dict[str, Any], *, config_fingerprint: str, trainer_step: int | None) -> str | None:
    """Why a restore passes over a snapshot that verifies; None when it would take it."""
    if manifest["config_fingerprint"] != config_fingerprint:
        return "written under another configuration"
    if trainer_step is not None and manifest["trainer"]["step"] != trainer_step:
        return f"anchored at trainer step {manifest['trainer']['step']}, not {trainer_step}"
    return None


def may_be_this_work(manifest: Any, config_fingerprint: str | None) -> bool:
    """Whether a snapshot that does not verify could hold this configuration's work: its manifest
    cannot say otherwise (unreadable, no fingerprint) or names this very configuration. A start never
    begins afresh over such a snapshot; one of other work is no reason to stop."""
    theirs = manifest.get("config_fingerprint") if isinstance(manifest, dict) else None
    return not isinstance(theirs, str) or config_fingerprint is None or theirs == config_fingerprint


def files_on_disk(directory: Path) -> dict[str, int]:
    """Every regular file under ``directory``: its path relative to it, and its size."""
    found: dict[str, int] = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = Path(parent) / name
            if path.is_file():
                found[path.relative_to(directory).as_posix()] = path.stat().st_size
    return found


def _validation(exc: msgspec.ValidationError, at: str) -> str:
    return str(exc).replace("`$", f"`{at}")


def _inside(directory: Path, relative: str) -> bool:
    if not relative or Path(relative).is_absolute():
        return False
    return os.path.normpath(directory / relative).startswith(os.path.normpath(directory) + os.sep)


# -- one snapshot ---------------------------------------------------------------------------------------


def read_manifest(directory: Path) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The manifest as JSON, or None with the problem that stops reading it."""
    name, path = directory.name, directory / "manifest.json"

    def problem(kind: Kind, detail: str) -> tuple[None, list[Problem]]:
        return None, [Problem(name, "manifest.json", kind, detail)]

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
    if manifest.get("schema") != MANIFEST_SCHEMA:
        return problem(Kind.SCHEMA, f"has schema {manifest.get('schema')!r}, expected {MANIFEST_SCHEMA}")
    return manifest, []


def check_snapshot(directory: Path, *, deep: bool = True) -> list[Problem]:
    """Every problem of the snapshot in ``directory``; empty when it verifies.

    ``deep=False`` makes only the checks a restore makes before it picks a snapshot: the manifest
    reads, fits its schema and names this run, every listed file is there with its size and sha256,
    and the ledger is listed, loads and agrees with the saved episodes."""
    name = directory.name
    manifest, problems = read_manifest(directory)
    if manifest is None:
        return problems

    head: ManifestHead | None = None
    try:
        head = msgspec.convert({k: v for k, v in manifest.items() if k != "files"}, ManifestHead)
    except msgspec.ValidationError as exc:
        problems.append(Problem(name, "manifest.json", Kind.SCHEMA, f"does not fit its schema: {exc}"))
    if head is not None and not is_valid_checkpoint_id(head.checkpoint_id):
        problems.append(
            Problem(
                name,
                "manifest.json",
                Kind.SCHEMA,
                f"has checkpoint id {head.checkpoint_id!r}: not a valid id",
            )
        )

    if head is not None and head.run != directory.parent.name:
        problems.append(
            Problem(
                name,
                "manifest.json",
                Kind.OTHER_RUN,
                f"names run {head.run!r}, but lies in the directory of run {directory.parent.name!r}: "
                "a manifest from another run",
            )
        )
    if deep and head is not None and name != f"snapshot_{head.seq}":
        problems.append(
            Problem(name, "manifest.json", Kind.SEQUENCE, f"says seq {head.seq}, but its directory is {name}")
        )

    raw_files = manifest.get("files")
    entries: list[ManifestFile] = []
    listed: set[str] = set()  # every path the manifest names, well formed or not (none of them is stray)
    if not isinstance(raw_files, list):
        problems.append(
            Problem(
                name,
                "manifest.json",
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
                    "manifest.json",
                    Kind.SCHEMA,
                    f"does not fit its schema: {_validation(exc, f'$.files[{i}]')}",
                )
            )
            continue
        if not _inside(directory, entry.path):
            problems.append(
                Problem(name, entry.path, Kind.SCHEMA, "is listed, but is not a path inside the snapshot")
            )
        elif entry.path == "manifest.json" or any(e.path == entry.path for e in entries):
            problems.append(Problem(name, entry.path, Kind.SCHEMA, "is listed twice"))
        else:
            entries.append(entry)
            if deep and head is not None and entry.checkpoint_id != head.checkpoint_id:
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
    if LEDGER_FILE not in listed:
        problems.append(
            Problem(name, LEDGER_FILE, Kind.MISSING, "is not listed in the manifest (a restore reads it)")
        )
    ledger: Any = None
    if LEDGER_FILE in intact:
        try:
            ledger = msgspec.msgpack.decode((directory / LEDGER_FILE).read_bytes())
        except msgspec.DecodeError as exc:
            problems.append(
                Problem(name, LEDGER_FILE, Kind.LEDGER, f"cannot be loaded: not MessagePack: {exc}")
            )
        else:
            if head is not None:
                problems += _check_ledger(name, ledger, head)
    if not deep:
        return problems

    on_disk = files_on_disk(directory)
    for path in sorted(set(on_disk) - listed - {"manifest.json", LEDGER_FILE}):
        problems.append(
            Problem(name, path, Kind.STRAY, f"is on disk ({on_disk[path]} bytes) but not in the manifest")
        )

    decoded: dict[str, Any] = {}
    for entry in entries:
        if entry.path not in intact or not entry.path.endswith(".msgpack") or entry.path == LEDGER_FILE:
            continue  # (the ledger was read above)
        try:
            decoded[entry.path] = msgspec.msgpack.decode((directory / entry.path).read_bytes())
        except msgspec.DecodeError as exc:
            problems.append(Problem(name, entry.path, Kind.RECORDS, f"is not valid MessagePack: {exc}"))
            continue
        value = decoded[entry.path]
        count = len(value) if isinstance(value, list) else None
        if count != entry.records:
            holds = f"{count} records" if count is not None else "no list of records"
            problems.append(
                Problem(name, entry.path, Kind.RECORDS, f"holds {holds}, manifest says {entry.records}")
            )

    if STAGING_FILE in decoded:
        try:
            missing = missing_staging_keys(directory, only=intact)
        except Undecodable as exc:
            problems.append(Problem(name, exc.path, Kind.RECORDS, f"does not decode: {exc.reason}"))
            missing = {}
        for path, keys in missing.items():
            shown = ", ".join(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")
            problems.append(
                Problem(
                    name, path, Kind.STAGING, f"references staging rows {STAGING_FILE} does not hold: {shown}"
                )
            )
    return problems


def _check_ledger(name: str, record: Any, head: ManifestHead) -> list[Problem]:
    """The ledger loads, and its dispatched attempts are the saved episodes (what a restore checks)."""
    from parkway.protocol.ledger import Ledger
    from parkway.protocol.snapshot import episode_mismatch

    try:
        ledger = Ledger.load(record["ledger"])
    except (KeyError, TypeError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        return [Problem(name, LEDGER_FILE, Kind.LEDGER, f"cannot be loaded: {type(exc).__name__}: {exc}")]
    saved = {(r, a) for r, a in head.episodes}
    restarts = {(r, a) for r, a in head.restarts}
    mismatch = episode_mismatch(saved - restarts, ledger.dispatched() - restarts)
    if mismatch:
        return [
            Problem(name, LEDGER_FILE, Kind.LEDGER, f"disagrees with the manifest's episodes: {mismatch}")
        ]
    return []


class Undecodable(Exception):
    """A snapshot file that does not decode as the records it should hold."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def _decode(directory: Path, relative: str, kind: Any) -> Any:
    try:
        return msgspec.msgpack.decode((directory / relative).read_bytes(), type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
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
    from parkway.protocol.messages import StagingRow
    from parkway.protocol.transcript import SavedRollout

    staging_type: Any = list[StagingRow] if strict else list[_StagingKey]
    rollouts_type: Any = list[SavedRollout] if strict else list[_RolloutKeys]
    captured = {f"{r.capture_key}:{r.turn}" for r in _decode(directory, STAGING_FILE, staging_type)}
    missing: dict[str, list[str]] = {}
    for rollouts in sorted((directory / "participants" / "agent").glob("*/rollouts.msgpack")):
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


# -- a run -------------------------------------------------------------------------------------------


@dataclass
class SnapshotInfo:
    """One snapshot directory as a listing shows it."""

    name: str
    path: Path
    seq: int
    size_bytes: int
    files: int
    created_at: float  # the manifest's creation time; the directory's mtime when it has none
    manifest: dict[str, Any] | None
    problem: Problem | None  # the first problem a restore would see; None when it verifies
    restore: bool = False  # the one a restore would start from
    skip_reason: str | None = None  # why a restore passes over it (None: taken, or an older one)

    @property
    def checkpoint_id(self) -> str | None:
        return _get(self.manifest, "checkpoint_id", str)

    @property
    def trainer_step(self) -> int | None:
        return _get(_get(self.manifest, "trainer", dict), "step", int)

    @property
    def policy_version(self) -> int | None:
        return _get(_get(self.manifest, "trainer", dict), "policy_version", int)

    @property
    def rollouts_saved(self) -> int | None:
        episodes = _get(self.manifest, "episodes", list)
        return len(episodes) if episodes is not None else None

    @property
    def restarts(self) -> int | None:
        restarts = _get(self.manifest, "restarts", list)
        return len(restarts) if restarts is not None else None

    @property
    def config_fingerprint(self) -> str | None:
        return _get(self.manifest, "config_fingerprint", str)

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "seq": self.seq,
            "checkpoint_id": self.checkpoint_id,
            "trainer_step": self.trainer_step,
            "policy_version": self.policy_version,
            "rollouts_saved": self.rollouts_saved,
            "restarts": self.restarts,
            "size_bytes": self.size_bytes,
            "files": self.files,
            "created_at": self.created_at,
            "age_s": round(now - self.created_at, 3),
            "config_fingerprint": self.config_fingerprint,
            "verifies": self.problem is None,
            "problem": self.problem.to_json() if self.problem else None,
            "restore": self.restore,
            "skip_reason": self.skip_reason,
        }


def _get(obj: Any, key: str, kind: type) -> Any:
    value = obj.get(key) if isinstance(obj, dict) else None
    if kind is int and isinstance(value, bool):
        return None
    return value if isinstance(value, kind) else None


@dataclass
class RunInventory:
    """The snapshots of one run directory, and what a restore of that run would do with them."""

    run_dir: Path
    snapshots: list[SnapshotInfo]
    completed_at: float | None  # the COMPLETED marker's time, when the run finished
    trainer_steps: list[int]
    temporary: list[str]  # tmp_* directories: a snapshot that never published (or one being written)
    config_fingerprint: str | None  # the configuration a restore is judged against
    config_source: str  # where that fingerprint came from
    restore_detail: str  # what a start of this run would do, in words
    fallback_step: int | None = None  # the trainer checkpoint a restore falls back to, without a snapshot

    @property
    def run(self) -> str:
        return self.run_dir.name

    @property
    def selected(self) -> SnapshotInfo | None:
        return next((s for s in self.snapshots if s.restore), None)

    def find(self, key: str) -> SnapshotInfo | None:
        """A snapshot by directory name (``snapshot_3``), sequence number (``3``) or checkpoint id."""
        for snapshot in self.snapshots:
            if key in (snapshot.name, str(snapshot.seq), snapshot.checkpoint_id):
                return snapshot
        return None

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "run": self.run,
            "run_dir": str(self.run_dir),
            "completed": self.completed_at is not None,
            "completed_at": self.completed_at,
            "trainer_checkpoints": self.trainer_steps,
            "temporary": self.temporary,
            "config_fingerprint": self.config_fingerprint,
            "config_source": self.config_source,
            "restore": {
                "snapshot": self.selected.name if self.selected else None,
                "fallback_trainer_step": self.fallback_step,
                "detail": self.restore_detail,
            },
            "snapshots": [s.to_json(now) for s in self.snapshots],
        }


def describe(directory: Path, seq: int) -> SnapshotInfo:
    """One snapshot with the checks a restore makes (``deep=False``): cheap enough for a listing."""
    manifest, _ = read_manifest(directory)
    problems = check_snapshot(directory, deep=False)
    on_disk = files_on_disk(directory)
    created = _get(manifest, "created_at", float) or _get(manifest, "created_at", int)
    if created is None:
        stat_of = directory / "manifest.json" if (directory / "manifest.json").exists() else directory
        created = stat_of.stat().st_mtime
    return SnapshotInfo(
        name=directory.name,
        path=directory,
        seq=seq,
        size_bytes=sum(on_disk.values()),
        files=len(on_disk),
        created_at=float(created),
        manifest=manifest,
        problem=problems[0] if problems else None,
    )


def inventory(
    run_dir: Path, *, config_fingerprint: str | None = None, config_source: str = ""
) -> RunInventory:
    """The snapshots of ``run_dir`` and the one a restore would start from, judged as
    ``SnapshotCoordinator.restore_if_any`` judges them. Without a ``config_fingerprint`` (no
    configuration given) the newest snapshot that verifies stands for the configuration."""
    snapshots = [describe(path, seq) for seq, path in list_snapshots(run_dir)]
    marker = run_dir / "COMPLETED"
    completed_at: float | None = None
    if marker.is_file():
        try:
            completed_at = float(marker.read_text().strip())
        except (OSError, ValueError):
            completed_at = marker.stat().st_mtime
    steps = trainer_steps(run_dir)
    trainer_step = steps[-1] if steps else None
    temporary = sorted(p.name for p in run_dir.glob("tmp_*")) if run_dir.is_dir() else []

    if config_fingerprint is None:
        newest_valid = next((s for s in reversed(snapshots) if s.problem is None), None)
        if newest_valid is not None:
            config_fingerprint = newest_valid.config_fingerprint
            config_source = f"assumed: the configuration of {newest_valid.name}, the newest that verifies"
        else:
            config_source = "none: no snapshot verifies and no configuration was given"

    found = RunInventory(
        run_dir=run_dir,
        snapshots=snapshots,
        completed_at=completed_at,
        trainer_steps=steps,
        temporary=temporary,
        config_fingerprint=config_fingerprint,
        config_source=config_source,
        restore_detail="",
    )
    if completed_at is not None:
        found.restore_detail = (
            "the run is marked completed: its next start begins afresh and deletes these snapshots"
        )
        return found
    for snapshot in reversed(snapshots):
        if snapshot.problem is not None:
            snapshot.skip_reason = f"does not verify: {snapshot.problem.file} {snapshot.problem.detail}"
            continue
        assert snapshot.manifest is not None
        reason = (
            skip_reason(snapshot.manifest, config_fingerprint=config_fingerprint, trainer_step=trainer_step)
            if config_fingerprint is not None
            else "no configuration to judge it by"
        )
        if reason is not None:
            snapshot.skip_reason = reason
            continue
        snapshot.restore = True
        found.restore_detail = f"a restore starts from {snapshot.name}"
        return found
    broken = [
        s.name
        for s in snapshots
        if s.problem is not None and may_be_this_work(s.manifest, config_fingerprint)
    ]
    if trainer_step is not None:
        found.fallback_step = trainer_step
        found.restore_detail = (
            f"no snapshot fits: a restore falls back to trainer checkpoint {trainer_step}'s marker "
            "(unfinished groups restart from their prompt)"
        )
    elif broken:
        found.restore_detail = (
            f"no snapshot verifies ({', '.join(broken)}): a start refuses to begin afresh over them; "
            "move them away to start afresh"
        )
    else:
        found.restore_detail = "no snapshot fits: a start begins afresh"
    return found
