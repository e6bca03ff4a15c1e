"""The timeline that survived: controller processes, the snapshots they restored, the seals they kept."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from parkway.protocol.history import (
    LedgerCaptured,
    Record,
    RestoreStarted,
    RolloutSealed,
    RunFinished,
    RunStarted,
    SnapshotPublished,
)

R = TypeVar("R", bound=Record)


@dataclass
class Incarnation:
    """One process of one role: its records, and which snapshot (by checkpoint id) it restored."""

    inc: str  # the process (and incarnation within it) that recorded these
    records: list[Record]

    @property
    def restored_cid(self) -> str | None:
        restore = next(iter(self.of(RestoreStarted)), None)
        return restore.saved_checkpoint_id if restore is not None else None

    @property
    def finished(self) -> RunFinished | None:
        return next(iter(self.of(RunFinished)), None)

    def of(self, kind: type[R]) -> list[R]:
        return [r for r in self.records if isinstance(r, kind)]


def incarnations(records: Iterable[Record], role: str = "controller") -> list[Incarnation]:
    by_inc: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        if record.role == role:
            by_inc[record.inc].append(record)
    found = [Incarnation(inc, sorted(rs, key=lambda r: r.n)) for inc, rs in by_inc.items()]
    return sorted(found, key=lambda inc: inc.records[0].t)


def surviving_seals(controllers: list[Incarnation]) -> tuple[list[RolloutSealed], list[str]]:
    """The seal records of the timeline that survived, oldest first, and how it was traced.

    Start from the last controller: all its seals. If it restored a snapshot, the controller that
    published that snapshot contributes its seals up to the ledger's capture, and so on back until a
    controller that started afresh. Seals of controllers whose work no snapshot kept are not in it."""
    if not controllers:
        return [], []
    publisher: dict[str, tuple[Incarnation, int]] = {}  # checkpoint id -> (incarnation, seals captured)
    for inc in controllers:
        captured = {r.checkpoint_id: r.seals for r in inc.of(LedgerCaptured)}
        for record in inc.of(SnapshotPublished):
            publisher[record.checkpoint_id] = (inc, captured.get(record.checkpoint_id, 0))
    final = next((inc for inc in reversed(controllers) if inc.finished is not None), controllers[-1])
    chain: list[RolloutSealed] = []
    trace = []
    current: Incarnation | None = final
    limit: int | None = None
    visited: set[str] = set()
    while current is not None and current.inc not in visited:
        visited.add(current.inc)
        seals = [r for r in current.of(RolloutSealed) if limit is None or r.seq <= limit]
        chain = seals + chain
        cid = current.restored_cid
        trace.append(f"controller {current.inc}: {len(seals)} seals" + (f", restored {cid}" if cid else ""))
        if cid is None or cid not in publisher:
            break
        current, limit = publisher[cid]
    return chain, trace


def expected_rollouts(controllers: list[Incarnation]) -> list[str]:
    for inc in reversed(controllers):
        for record in inc.of(RunStarted):
            return list(record.expected)
    return []
