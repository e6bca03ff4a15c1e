"""The participant phase machine (docs/protocol.md#participant-phases-and-leases), as one transition table with no I/O.

    idle -> preparing -> prepared -> committed -> idle      (prepare, parked, commit, resume)
    idle -> restored -> idle                                 (restore, resume)
    any phase -> idle                                        (abort, lease lapse)

The machine also fences ids: an id that ended here (resumed, aborted, lapsed) is remembered, so a late
Prepare of an aborted id is refused with ``stale_checkpoint``; a command for another id while one is
active is refused with ``checkpoint_conflict``; a command past its deadline with ``deadline_exceeded``.
Re-sent Resume or Abort of an id that already ended are no-ops, so retries are safe.

Time is passed in (``now``), never read, so tests drive the lease with plain numbers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from parkway.protocol.errors import ErrorCode, ProtocolError


class Phase(StrEnum):
    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


class Event(StrEnum):
    PREPARE = "prepare"
    PARKED = "parked"  # internal: every rollout of the participant reached a boundary
    RENEW = "renew"
    COMMIT = "commit"
    RESUME = "resume"
    ABORT = "abort"
    RESTORE = "restore"
    LEASE_LAPSED = "lease_lapsed"  # internal: the lease ran out with no word from the controller


# The legal moves. Every (phase, event) pair not listed is illegal and raises ``invalid_phase``.
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (Phase.IDLE, Event.PREPARE): Phase.PREPARING,
    (Phase.PREPARING, Event.PARKED): Phase.PREPARED,
    (Phase.PREPARING, Event.RENEW): Phase.PREPARING,
    (Phase.PREPARED, Event.RENEW): Phase.PREPARED,
    (Phase.COMMITTED, Event.RENEW): Phase.COMMITTED,
    (Phase.RESTORED, Event.RENEW): Phase.RESTORED,
    (Phase.PREPARED, Event.COMMIT): Phase.COMMITTED,
    (Phase.COMMITTED, Event.RESUME): Phase.IDLE,
    (Phase.RESTORED, Event.RESUME): Phase.IDLE,
    (Phase.IDLE, Event.RESTORE): Phase.RESTORED,
    (Phase.PREPARING, Event.ABORT): Phase.IDLE,
    (Phase.PREPARED, Event.ABORT): Phase.IDLE,
    (Phase.COMMITTED, Event.ABORT): Phase.IDLE,
    (Phase.RESTORED, Event.ABORT): Phase.IDLE,
    (Phase.PREPARING, Event.LEASE_LAPSED): Phase.IDLE,
    (Phase.PREPARED, Event.LEASE_LAPSED): Phase.IDLE,
    (Phase.COMMITTED, Event.LEASE_LAPSED): Phase.IDLE,
    (Phase.RESTORED, Event.LEASE_LAPSED): Phase.IDLE,
}

# Events that start a checkpoint (they set the active id) and events that end one (they fence it).
STARTS = frozenset({Event.PREPARE, Event.RESTORE})
ENDS = frozenset({Event.RESUME, Event.ABORT, Event.LEASE_LAPSED})
INTERNAL = frozenset({Event.PARKED, Event.LEASE_LAPSED})

DEFAULT_LEASE_GRACE_S = 5.0
DEFAULT_MAX_LEASE_S = 3600.0  # the actors' default deadline horizon (PARKWAY_MAX_DEADLINE_S)
DEFAULT_FENCE_MEMORY = 256


class Outcome(StrEnum):
    MOVED = "moved"  # a transition happened
    ALREADY_ENDED = "already_ended"  # resume/abort of an id that ended before: nothing to do
    FENCED = "fenced"  # abort of an id never seen: remembered so it can never start


@dataclass(frozen=True, slots=True)
class Transition:
    event: Event
    checkpoint_id: str
    before: Phase
    after: Phase
    outcome: Outcome


@dataclass(slots=True)
class ParticipantPhases:
    """One participant's phase, active id, lease and fence. Pure; the caller does the I/O."""

    lease_grace_s: float = DEFAULT_LEASE_GRACE_S
    max_lease_s: float = DEFAULT_MAX_LEASE_S
    fence_memory: int = DEFAULT_FENCE_MEMORY
    phase: Phase = Phase.IDLE
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    _ended: OrderedDict[str, Event] = field(init=False, repr=False, default_factory=OrderedDict)

    def ended_by(self, checkpoint_id: str) -> Event | None:
        """How a fenced id ended (resume, abort, lease_lapsed), or None if it is not fenced."""
        return self._ended.get(checkpoint_id)

    def check(
        self, event: Event, checkpoint_id: str, *, now: float, deadline: float | None = None
    ) -> Transition:
        """What ``apply`` would do, without doing it (raises the same errors)."""
        before = self.phase
        if event in ENDS and checkpoint_id in self._ended:
            return Transition(event, checkpoint_id, before, before, Outcome.ALREADY_ENDED)
        if checkpoint_id in self._ended:
            raise ProtocolError(
                ErrorCode.STALE_CHECKPOINT,
                f"{event.value} of {checkpoint_id}: that id already ended here "
                f"({self._ended[checkpoint_id].value})",
            )
        if event not in INTERNAL and deadline is not None and deadline <= now:
            raise ProtocolError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"{event.value} of {checkpoint_id}: deadline passed {now - deadline:.3f}s ago",
            )
        if event is Event.ABORT and checkpoint_id != self.checkpoint_id:
            # Abort of an id that is not active here: fence it so a late Prepare cannot start it.
            return Transition(event, checkpoint_id, before, before, Outcome.FENCED)
        if self.checkpoint_id is not None and checkpoint_id != self.checkpoint_id:
            raise ProtocolError(
                ErrorCode.CHECKPOINT_CONFLICT,
                f"{event.value} of {checkpoint_id}: checkpoint {self.checkpoint_id} is active ({before.value})",
            )
        after = TRANSITIONS.get((before, event))
        if after is None:
            raise ProtocolError(
                ErrorCode.INVALID_PHASE,
                f"{event.value} of {checkpoint_id} is illegal in phase {before.value}",
            )
        return Transition(event, checkpoint_id, before, after, Outcome.MOVED)

    def apply(
        self, event: Event, checkpoint_id: str, *, now: float, deadline: float | None = None
    ) -> Transition:
        """Apply one event for one id, or raise ``ProtocolError`` saying why it is refused."""
        transition = self.check(event, checkpoint_id, now=now, deadline=deadline)
        if transition.outcome is Outcome.FENCED:
            self._fence(checkpoint_id, event)
        if transition.outcome is not Outcome.MOVED:
            return transition
        self.phase = transition.after
        if event in STARTS:
            self.checkpoint_id = checkpoint_id
        if event in STARTS or event is Event.RENEW:
            # However far out the deadline (a sender's mistake or a hostile one), the lease is never
            # longer than ``max_lease_s``: one command can never hold a participant for good.
            held_until = None if deadline is None else min(deadline, now + self.max_lease_s)
            self.lease_expires_at = None if held_until is None else held_until + self.lease_grace_s
        if event in ENDS:
            self._fence(checkpoint_id, event)
            self.checkpoint_id = None
            self.lease_expires_at = None
        return transition

    def lapse_if_expired(self, now: float) -> Transition | None:
        """Self-resume when the lease ran out: a lost Resume never holds a participant for long."""
        if self.checkpoint_id is None or self.lease_expires_at is None or now < self.lease_expires_at:
            return None
        return self.apply(Event.LEASE_LAPSED, self.checkpoint_id, now=now)

    def _fence(self, checkpoint_id: str, how: Event) -> None:
        self._ended[checkpoint_id] = how
        self._ended.move_to_end(checkpoint_id)
        while len(self._ended) > self.fence_memory:
            self._ended.popitem(last=False)
