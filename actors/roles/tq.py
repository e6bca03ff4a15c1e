"""The TransferQueue actor: staging rows per model call, canonical rows per sealed rollout.

Staging rows are keyed by (capture key, turn); a row that arrives twice with the same tokens is a
duplicate delivery and is dropped. Lineage counts how often each (logical rollout, turn) was generated
across attempts, so ``turns_regenerated`` says how much work a recovery threw away.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
from parkway.actors.runtime.packs import read_records, write_records
from parkway.actors.runtime.participant import Cut, ParkReport, Participant
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import Refused, RowSealed, RowStaged, RowUnsealed, SnapshotInstalled
from parkway.protocol.ids import Role, capture_key, parse_capture_key, parse_staging_key
from parkway.protocol.messages import (
    AttemptRef,
    CanonicalRow,
    CanonicalRows,
    Commit,
    FetchRows,
    FileDigest,
    Message,
    Ok,
    Prepare,
    ReleaseRows,
    Restore,
    Retire,
    Rows,
    SealRows,
    StagingRow,
)

log = structlog.get_logger("parkway.tq")


def attempt_of(key: str) -> tuple[str, int]:
    """(logical rollout id, attempt) of a row's capture key (``g_g1-a2`` -> (``g_g1``, 2); no suffix: 0).

    TQ stores the rows it is sent whatever their keys: a key no builder makes (a foreign or fuzzed
    client's) is a rollout of its own at attempt 0, as it always was, rather than a refused row."""
    try:
        return parse_capture_key(key)
    except ValueError:
        return key, 0


def logical_id(key: str) -> str:
    """The logical rollout id of a capture key (``g_g1-a2`` -> ``g_g1``)."""
    return attempt_of(key)[0]


class TransferStore:
    """The rows themselves. Pure: the actor wraps it; save/load go to one directory.

    A capture key's rows are a dict that is replaced, never changed in place (a row added makes a new
    one): a shallow copy of ``staging`` is then a snapshot of every row, which is what a cut takes."""

    def __init__(self) -> None:
        self.staging: dict[str, dict[int, StagingRow]] = {}  # capture key -> turn -> row
        self.canonical: dict[str, CanonicalRow] = {}
        self.generations: collections.Counter[tuple[str, int]] = collections.Counter()
        self.keys: dict[str, set[str]] = {}  # logical rollout id -> capture keys of its staging rows
        self.duplicates = 0
        self.regenerated = 0

    def add(self, row: StagingRow) -> bool:
        """Store one staging row; False for a duplicate delivery of a row already stored."""
        turns = self.staging.get(row.capture_key, {})
        if row.turn in turns:
            self.duplicates += 1
            return False
        self.staging[row.capture_key] = {**turns, row.turn: row}  # replaced: a cut may hold the old one
        logical = logical_id(row.capture_key)
        self.keys.setdefault(logical, set()).add(row.capture_key)
        lineage = (logical, row.turn)
        self.generations[lineage] += 1
        if self.generations[lineage] > 1:
            self.regenerated += 1
        return True

    def seal(
        self,
        rollout_id: str,
        attempt: int,
        capture_key: str,
        reward: float,
        staging_keys: tuple[str, ...] = (),
    ) -> CanonicalRow:
        existing = self.canonical.get(rollout_id)
        if existing is not None and existing.capture_key == capture_key:
            return existing  # sealing twice is a no-op
        if staging_keys:
            turns = tuple(self._row(key) for key in staging_keys)
        else:
            turns = tuple(row for _, row in sorted(self.staging.get(capture_key, {}).items()))
        if not turns:
            raise ProtocolError(ErrorCode.UNAVAILABLE, f"no staging rows for {capture_key} yet")
        row = CanonicalRow(
            rollout_id=rollout_id, attempt=attempt, capture_key=capture_key, reward=reward, turns=turns
        )
        self.canonical[rollout_id] = row
        return row

    def unseal(self, rollout_id: str, attempt: int) -> CanonicalRow | None:
        """Drop the canonical row of ``rollout_id`` if ``attempt`` made it (it was fenced: the ledger
        never sealed it and never will); its staging rows stay, a continuation may use them."""
        row = self.canonical.get(rollout_id)
        if row is None or row.attempt != attempt:
            return None
        return self.canonical.pop(rollout_id)

    def _row(self, key: str) -> StagingRow:
        row = self._find(key)
        if row is None:
            raise ProtocolError(ErrorCode.UNAVAILABLE, f"no staging row {key} yet")
        return row

    def has(self, key: str) -> bool:
        return self._find(key) is not None

    def _find(self, key: str) -> StagingRow | None:
        """The staging row of a staging key; None when absent, or when the key is not one (it names
        no row, as for any unknown key: the sender gets "not there yet", not a broken TQ)."""
        try:
            capture, turn = parse_staging_key(key)
        except ValueError:
            return None
        return self.staging.get(capture, {}).get(turn)

    def forget(self, attempts: list[tuple[str, int]]) -> int:
        """Drop the staging rows of forgotten attempts that no canonical row uses (a retried rollout's
        earlier attempts); the canonical row and its rows stay until the trainer releases them.
        Returns the staging rows dropped."""
        dropped = 0
        for rollout_id, attempt in attempts:
            key = capture_key(rollout_id, attempt)
            canonical = self.canonical.get(rollout_id)
            if canonical is not None and any(t.capture_key == key for t in canonical.turns):
                continue
            dropped += len(self.staging.pop(key, {}))
            keys = self.keys.get(rollout_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.keys[rollout_id]
        return dropped

    def leave_out(self, attempts: tuple[AttemptRef, ...]) -> None:
        """Drop the rows of ``attempts`` and their count in the lineage (a cut's copy: a restore starts
        them from their prompts, so generating their turns again repeats nothing it saved)."""
        for ref in attempts:
            for turn in self.staging.pop(capture_key(ref.rollout_id, ref.attempt), {}):
                lineage = (ref.rollout_id, turn)
                if self.generations[lineage] <= 1:
                    self.generations.pop(lineage, None)
                else:
                    self.generations[lineage] -= 1

    def release(self, rollout_ids: tuple[str, ...]) -> int:
        """Drop what the trainer consumed: each rollout's canonical row and the staging rows of all its
        attempts; lineage keeps only the turns generated more than once (``turns_regenerated`` stays
        exact). Without this every snapshot would write every row of the run so far. Returns the
        staging rows dropped."""
        dropped = 0
        for rollout_id in rollout_ids:
            self.canonical.pop(rollout_id, None)
            for key in self.keys.pop(rollout_id, ()):
                for turn in self.staging.pop(key, {}):
                    dropped += 1
                    if self.generations.get((rollout_id, turn), 0) <= 1:
                        self.generations.pop((rollout_id, turn), None)
        return dropped

    @property
    def turns_regenerated(self) -> int:
        """Turn generations repeated for the same logical rollout and turn (work a recovery threw away)."""
        return self.regenerated

    def frozen(self) -> TransferStore:
        """A copy that shares every row and that nothing changes: what a cut holds until it is written
        (shallow copies of three dicts; the rows of a capture key are never changed in place)."""
        copy = TransferStore()
        copy.staging = dict(self.staging)
        copy.canonical = dict(self.canonical)
        copy.generations = collections.Counter(self.generations)
        return copy

    def save(
        self,
        directory: Path,
        write: Callable[[Path, list[Any]], FileDigest] = write_records,
        packed: Callable[[Path, list[Any]], tuple[FileDigest, ...]] | None = None,
    ) -> tuple[FileDigest, ...]:
        """The rows (written incrementally with ``packed``: a row never changes once staged) and the
        lineage counts."""
        staging = [row for key in sorted(self.staging) for _, row in sorted(self.staging[key].items())]
        canonical = sorted(self.canonical.values(), key=lambda r: r.rollout_id)
        lineage = sorted([k, t, n] for (k, t), n in self.generations.items())
        rows = packed or (lambda path, records: (write(path, records),))
        return (
            *rows(directory / "staging.msgpack", staging),
            *rows(directory / "canonical.msgpack", canonical),
            write(directory / "lineage.msgpack", lineage),
        )

    @classmethod
    def load(cls, directory: Path) -> TransferStore:
        store = cls()
        staging = read_records(directory / "staging.msgpack", StagingRow)
        canonical = read_records(directory / "canonical.msgpack", CanonicalRow)
        lineage = msgspec.msgpack.decode(
            (directory / "lineage.msgpack").read_bytes(), type=list[tuple[str, int, int]]
        )
        for row in staging:
            store.staging.setdefault(row.capture_key, {})[row.turn] = row
            store.keys.setdefault(logical_id(row.capture_key), set()).add(row.capture_key)
        store.canonical = {r.rollout_id: r for r in canonical}
        store.generations = collections.Counter({(k, t): n for k, t, n in lineage})
        store.regenerated = sum(n - 1 for n in store.generations.values() if n > 1)
        return store

    def digest(self) -> str:
        """One hash over every canonical row's tokens: equal transcripts, equal digests."""
        h = hashlib.sha256()
        for rollout_id in sorted(self.canonical):
            for turn in self.canonical[rollout_id].turns:
                h.update(f"{rollout_id}:{turn.turn}:".encode() + bytes(str(turn.token_ids), "ascii"))
        return h.hexdigest()


class TransferQueue(Participant):
    role = Role.TQ
    prefetch = 256
    # A trainer's read of canonical rows is answered fresh, never cached: each read has its own id, so
    # a cached copy (about 7 KB a group) was never read again, and it filled TQ's reply cache to its
    # byte bound in the 100,000-rollout soak.
    queries = (*Participant.queries, FetchRows)
    idempotent = (*Participant.idempotent, ReleaseRows)  # rows released twice: nothing more to drop

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store = TransferStore()
        self.handlers.update(
            {
                Rows: self.on_rows,
                SealRows: self.on_seal_rows,
                FetchRows: self.on_fetch_rows,
                ReleaseRows: self.on_release_rows,
            }
        )

    async def on_rows(self, message: Rows) -> None:
        for row in message.rows:
            attempt = attempt_of(row.capture_key)
            if attempt in self.retired or attempt in self.forgotten:  # given up on, or long finished
                self.counts["staging_fenced"] += 1
                self.history.record(Refused(capture_key=row.capture_key, turn=row.turn, code="stale_attempt"))
                continue
            if self.store.add(row):
                self.counts["staging_rows"] += 1
                self.counts["turns_regenerated"] = self.store.turns_regenerated
                self.history.record(RowStaged(capture_key=row.capture_key, turn=row.turn))
            else:
                self.counts["staging_duplicates"] += 1

    async def on_seal_rows(self, message: SealRows) -> Message:
        await self.faults.hold("tq_seal")
        if (message.rollout_id, message.attempt) in self.retired:
            # Fenced here: the controller gave up on it (its seal came late, or was requeued by a
            # broker restart), and a canonical row of it would be replaced by its next attempt's.
            self.counts["seals_fenced"] += 1
            raise ProtocolError(
                ErrorCode.STALE_ATTEMPT, f"{message.rollout_id} attempt {message.attempt} is fenced here"
            )
        before = self.store.canonical.get(message.rollout_id)
        row = self.store.seal(
            message.rollout_id, message.attempt, message.capture_key, message.reward, message.staging_keys
        )
        self.counts["canonical_rows"] = len(self.store.canonical)
        if row is not before:
            self.history.record(
                RowSealed(
                    rollout_id=row.rollout_id,
                    attempt=row.attempt,
                    capture_key=row.capture_key,
                    turns=tuple(t.turn for t in row.turns),
                    replaced=before.capture_key if before is not None else None,
                )
            )
        return Ok(detail=f"{len(row.turns)} turns")

    async def on_fetch_rows(self, message: FetchRows) -> Message:
        rows = tuple(self.store.canonical[r] for r in message.rollout_ids if r in self.store.canonical)
        missing = tuple(r for r in message.rollout_ids if r not in self.store.canonical)
        return CanonicalRows(rows=rows, missing=missing)

    async def on_release_rows(self, message: ReleaseRows) -> Message:
        dropped = self.store.release(message.rollout_ids)
        self.counts["rows_released"] += dropped
        self.counts["canonical_rows"] = len(self.store.canonical)
        return Ok(detail=f"released {dropped} staging rows of {len(message.rollout_ids)} rollouts")

    async def on_retire(self, command: Retire) -> Message:
        """A fenced attempt holds no canonical row: one sealed here just before the controller gave
        up on it (its receipt was late and the stall watchdog failed it) goes with the fence."""
        reply = await super().on_retire(command)
        for ref in command.attempts:
            row = self.store.unseal(ref.rollout_id, ref.attempt)
            if row is not None:
                self.counts["canonical_unsealed"] += 1
                self.counts["canonical_rows"] = len(self.store.canonical)
                self.history.record(
                    RowUnsealed(rollout_id=row.rollout_id, attempt=row.attempt, capture_key=row.capture_key)
                )
        return reply

    def parked_now(self, command: Prepare) -> ParkReport:
        # Nothing to park: its Prepare and Commit go out back to back, on its data lane.
        return ParkReport()

    def forget_attempts(self, keys: list[tuple[str, int]]) -> None:
        self.counts["rows_forgotten"] += self.store.forget(keys)

    def structure_sizes(self) -> dict[str, int]:
        return {
            **super().structure_sizes(),
            "staging": len(self.store.staging),
            "canonical": len(self.store.canonical),
            "lineage": len(self.store.generations),
            "staging_keys": len(self.store.keys),
        }

    def take_cut(self, command: Commit) -> Cut:
        """Every row at this instant. The controller sends this Commit on the data lane, behind the rows
        already sent here: the rows the agents' cuts refer to were sent before those agents prepared."""
        frozen = self.store.frozen()
        frozen.leave_out(command.left_out)  # (a copy: the live rows stay)
        return Cut(write=lambda d: frozen.save(d, write=self.records.plain, packed=self.records.packed))

    async def install_snapshot(self, directory: Path, command: Restore) -> tuple[AttemptRef, ...]:
        self.store = TransferStore.load(directory)
        self.history.record(
            SnapshotInstalled(
                checkpoint_id=command.checkpoint_id,
                location=command.location,
                staged=sum(len(turns) for turns in self.store.staging.values()),
                canonical=tuple(sorted(self.store.canonical)),
            )
        )
        return ()
