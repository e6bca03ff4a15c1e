"""The cuts a participant holds between a snapshot's Commit and its Persist, as a table with no I/O.

A Commit takes the cut inside the admission-closed window: an immutable in-memory copy of what the
snapshot keeps, nothing written. The Persist that comes after the window writes it::

    (none) -> taken -> writing -> written        (commit, persist, the write returned)
    writing -> taken                              (the write failed: a Persist may try again)
    taken | writing | written -> (none)           (abort)

A Persist of an id that has no cut here (it was never committed here, it was aborted, or this process
started after the Commit and lost it) is refused with ``stale_checkpoint``: the controller aborts that
snapshot and the one before stays authoritative. A participant keeps the cuts of its last few ids only.

Nothing here knows what a cut holds: ``CutTable`` is generic over it, and the participant keeps the
held value (its rollouts, sessions or rows) as long as the cut is ``taken`` or ``writing``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from parkway.protocol.errors import ErrorCode, ProtocolError


class CutPhase(StrEnum):
    TAKEN = "taken"
    WRITING = "writing"
    WRITTEN = "written"


class CutEvent(StrEnum):
    TAKE = "take"  # Commit
    PERSIST = "persist"  # Persist: the write starts
    WRITTEN = "written"  # the write returned its files
    FAILED = "failed"  # the write failed (a full disk): the cut is kept for the Abort, or a retry


# The legal moves; every other (phase, event) pair raises. ``None``: no cut of that id here.
TRANSITIONS: dict[tuple[CutPhase | None, CutEvent], CutPhase] = {
    (None, CutEvent.TAKE): CutPhase.TAKEN,
    (CutPhase.TAKEN, CutEvent.PERSIST): CutPhase.WRITING,
    (CutPhase.WRITING, CutEvent.WRITTEN): CutPhase.WRITTEN,
    (CutPhase.WRITING, CutEvent.FAILED): CutPhase.TAKEN,
}

DEFAULT_CUTS_KEPT = 4  # the newest ids; an older cut never persisted belongs to a snapshot long given up

Held = TypeVar("Held")


@dataclass(slots=True)
class _Cut(Generic[Held]):
    phase: CutPhase
    held: Held | None  # dropped once written: the files are the record from then on


@dataclass(slots=True)
class CutTable(Generic[Held]):
    """One participant's cuts by checkpoint id. Pure; the participant does the writing."""

    kept: int = DEFAULT_CUTS_KEPT
    _cuts: OrderedDict[str, _Cut[Held]] = field(init=False, repr=False, default_factory=OrderedDict)

    def phase(self, checkpoint_id: str) -> CutPhase | None:
        cut = self._cuts.get(checkpoint_id)
        return None if cut is None else cut.phase

    def _move(self, checkpoint_id: str, event: CutEvent) -> _Cut[Held] | None:
        before = self.phase(checkpoint_id)
        after = TRANSITIONS.get((before, event))
        if after is None:
            if before is None and event is CutEvent.PERSIST:
                raise ProtocolError(
                    ErrorCode.STALE_CHECKPOINT,
                    f"persist of {checkpoint_id}: no cut of it here (never committed, aborted, or taken "
                    f"by a process that has since stopped)",
                )
            raise ProtocolError(
                ErrorCode.INVALID_PHASE,
                f"{event.value} of {checkpoint_id} is illegal for a cut "
                f"{before.value if before is not None else 'not taken'}",
            )
        cut = self._cuts.get(checkpoint_id)
        if cut is not None:
            cut.phase = after
        return cut

    def take(self, checkpoint_id: str, held: Held) -> None:
        """Commit: hold ``held`` as this id's cut."""
        self._move(checkpoint_id, CutEvent.TAKE)
        self._cuts[checkpoint_id] = _Cut(CutPhase.TAKEN, held)
        while len(self._cuts) > self.kept:
            self._cuts.popitem(last=False)

    def persist(self, checkpoint_id: str) -> Held:
        """Persist: the write starts; what to write."""
        cut = self._move(checkpoint_id, CutEvent.PERSIST)
        assert cut is not None and cut.held is not None
        return cut.held

    def written(self, checkpoint_id: str) -> None:
        """The write returned: the cut's copy is let go (its files hold it now)."""
        cut = self._move(checkpoint_id, CutEvent.WRITTEN)
        if cut is not None:
            cut.held = None

    def failed(self, checkpoint_id: str) -> None:
        """The write failed: the cut is held as taken again."""
        self._move(checkpoint_id, CutEvent.FAILED)

    def drop(self, checkpoint_id: str) -> bool:
        """Abort: the id has no cut here any more. True when it had one."""
        return self._cuts.pop(checkpoint_id, None) is not None

    def __len__(self) -> int:
        return len(self._cuts)

    def holding(self) -> int:
        """Cuts whose copy is still held (not written yet)."""
        return sum(1 for cut in self._cuts.values() if cut.held is not None)
