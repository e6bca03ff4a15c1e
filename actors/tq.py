"""The TransferQueue actor: staging rows per model call, canonical rows per sealed rollout.

Staging rows are keyed by (capture key, turn); a row that arrives twice with the same tokens is a
duplicate delivery and is dropped. Lineage counts how often each (logical rollout, turn) was generated
across attempts, so ``turns_regenerated`` says how much work a recovery threw away.
"""

from __future__ import annotations

import collections
import hashlib
import re
from pathlib import Path

import msgspec
import structlog
from parkway.actors.participant import Participant, write_records
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import (
    AttemptRef,
    CanonicalRow,
    CanonicalRows,
    Commit,
    FetchRows,
    FileDigest,
    Message,
    Ok,
    Restore,
    Rows,
    SealRows,
    StagingRow,
)

log = structlog.get_logger("parkway.tq")

_ATTEMPT_SUFFIX = re.compile(r"-a\d+$")


def logical_id(capture_key: str) -> str:
    """The logical rollout id of a capture key (``g_g1-a2`` -> ``g_g1``)."""
    return _ATTEMPT_SUFFIX.sub("", capture_key)


def attempt_of(capture_key: str) -> tuple[str, int]:
    """(logical rollout id, attempt) of a capture key (``g_g1-a2`` -> (``g_g1``, 2); no suffix: 0)."""
    match = _ATTEMPT_SUFFIX.search(capture_key)
    return (logical_id(capture_key), int(match[0][2:])) if match else (capture_key, 0)


class TransferStore:
    """The rows themselves. Pure: the actor wraps it; save/load go to one directory."""

    def __init__(self) -> None:
        self.staging: dict[str, dict[int, StagingRow]] = {}  # capture key -> turn -> row
        self.canonical: dict[str, CanonicalRow] = {}
        self.generations: collections.Counter[tuple[str, int]] = collections.Counter()
        self.duplicates = 0
        self.regenerated = 0

    def add(self, row: StagingRow) -> bool:
        """Store one staging row; False for a duplicate delivery of a row already stored."""
        turns = self.staging.setdefault(row.capture_key, {})
        if row.turn in turns:
            self.duplicates += 1
            return False
        turns[row.turn] = row
        lineage = (logical_id(row.capture_key), row.turn)
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

    def _row(self, staging_key: str) -> StagingRow:
        key, _, turn = staging_key.rpartition(":")
        row = self.staging.get(key, {}).get(int(turn)) if turn.isdigit() else None
        if row is None:
            raise ProtocolError(ErrorCode.UNAVAILABLE, f"no staging row {staging_key} yet")
        return row

    def has(self, staging_key: str) -> bool:
        key, _, turn = staging_key.rpartition(":")
        return turn.isdigit() and int(turn) in self.staging.get(key, {})

    @property
    def turns_regenerated(self) -> int:
        """Turn generations repeated for the same logical rollout and turn (work a recovery threw away)."""
        return self.regenerated

    def save(self, directory: Path) -> tuple[FileDigest, ...]:
        staging = [row for key in sorted(self.staging) for _, row in sorted(self.staging[key].items())]
        canonical = sorted(self.canonical.values(), key=lambda r: r.rollout_id)
        lineage = sorted([k, t, n] for (k, t), n in self.generations.items())
        return (
            write_records(directory / "staging.msgpack", staging),
            write_records(directory / "canonical.msgpack", canonical),
            write_records(directory / "lineage.msgpack", lineage),
        )

    @classmethod
    def load(cls, directory: Path) -> TransferStore:
        store = cls()
        staging = msgspec.msgpack.decode((directory / "staging.msgpack").read_bytes(), type=list[StagingRow])
        canonical = msgspec.msgpack.decode(
            (directory / "canonical.msgpack").read_bytes(), type=list[CanonicalRow]
        )
        lineage = msgspec.msgpack.decode(
            (directory / "lineage.msgpack").read_bytes(), type=list[tuple[str, int, int]]
        )
        for row in staging:
            store.staging.setdefault(row.capture_key, {})[row.turn] = row
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
    role = "tq"
    prefetch = 256

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.store = TransferStore()
        self.handlers.update({Rows: self.on_rows, SealRows: self.on_seal_rows, FetchRows: self.on_fetch_rows})

    async def on_rows(self, message: Rows) -> None:
        for row in message.rows:
            if attempt_of(row.capture_key) in self.retired:  # fenced: generated for an attempt given up on
                self.counts["staging_fenced"] += 1
                self.history.record("refused", ck=row.capture_key, i=row.turn, code="stale_attempt")
                continue
            if self.store.add(row):
                self.counts["staging_rows"] += 1
                self.counts["turns_regenerated"] = self.store.turns_regenerated
                self.history.record("staged", ck=row.capture_key, i=row.turn)
            else:
                self.counts["staging_duplicates"] += 1

    async def on_seal_rows(self, message: SealRows) -> Message:
        before = self.store.canonical.get(message.rollout_id)
        row = self.store.seal(
            message.rollout_id, message.attempt, message.capture_key, message.reward, message.staging_keys
        )
        self.counts["canonical_rows"] = len(self.store.canonical)
        if row is not before:
            self.history.record(
                "sealed",
                r=row.rollout_id,
                a=row.attempt,
                ck=row.capture_key,
                turns=[t.turn for t in row.turns],
                replaced=before.capture_key if before is not None else None,
            )
        return Ok(detail=f"{len(row.turns)} turns")

    async def on_fetch_rows(self, message: FetchRows) -> Message:
        rows = tuple(self.store.canonical[r] for r in message.rollout_ids if r in self.store.canonical)
        missing = tuple(r for r in message.rollout_ids if r not in self.store.canonical)
        return CanonicalRows(rows=rows, missing=missing)

    def participant_dir(self, location: str) -> Path:
        # TQ's rows sit at the snapshot's top level (``tq/``), beside the ledger they are cut with.
        return super().participant_dir(location).parents[2] / "tq"

    async def write_snapshot(self, directory: Path, command: Commit) -> tuple[FileDigest, ...]:
        return self.store.save(directory)

    async def install_snapshot(self, directory: Path, command: Restore) -> tuple[AttemptRef, ...]:
        self.store = TransferStore.load(directory)
        self.history.record(
            "restored",
            cid=command.checkpoint_id,
            location=command.location,
            staged=sum(len(turns) for turns in self.store.staging.values()),
            canonical=sorted(self.store.canonical),
        )
        return ()
