"""The recovery ledger (docs/protocol.md#the-ledger): every prompt group, sibling and attempt the controller owns.

Metadata only, no I/O. Every state change goes through one of two transition tables; anything else
raises ``LedgerError`` (an invariant violation, never a wire error). Stale or duplicate reports from
agents are not errors of the ledger: ``seal`` and ``fail`` say what they did with them.

    group:   GENERATING -> READY_TO_FINALIZE -> FINALIZING -> (removed)
    attempt: RESERVED -> DISPATCHED -> SEALING -> SEALED;  DISPATCHED | SEALING -> FAILED | ABANDONED;
             ABANDONED -> RETIRED

``SEALING``: the attempt's receipt arrived and its canonical row is being made in TQ. Its agent is done
with it, so a snapshot neither waits for nor restarts it: the ledger a snapshot saves holds the
receipt (reward, turns, staging keys), and a restore seals it again (TQ's seal is idempotent per
capture key) before anything is dispatched (docs/snapshots.md#receipts-in-the-cut).

Identities: the logical rollout id ``{group_id}_g{i}`` is stable across attempts; the attempt index is
allocated at reservation, +1 per new attempt; the capture key is ``<logical>`` for attempt 0 and
``<logical>-a<N>`` after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

import msgspec
from parkway.protocol.ids import capture_key, rollout_id


class LedgerError(Exception):
    """A transition the ledger forbids: a bug in the caller, never bad input from the wire."""


class GroupState(StrEnum):
    GENERATING = "generating"
    READY_TO_FINALIZE = "ready_to_finalize"
    FINALIZING = "finalizing"


class AttemptState(StrEnum):
    RESERVED = "reserved"
    DISPATCHED = "dispatched"
    SEALING = "sealing"  # its receipt arrived; its canonical row is being made in TQ
    SEALED = "sealed"
    FAILED = "failed"
    ABANDONED = "abandoned"
    RETIRED = "retired"


class AttemptEvent(StrEnum):
    DISPATCH = "dispatch"
    RECEIVE = "receive"  # its agent's Completed receipt
    SEAL = "seal"
    FAIL = "fail"
    ABANDON = "abandon"
    RETIRE = "retire"


class GroupEvent(StrEnum):
    SETTLE = "settle"  # every sibling is sealed or failed for good
    FINALIZE = "finalize"  # the trainer takes it
    REOPEN = "reopen"  # a prompt_group redo after a failure


class Granularity(StrEnum):
    PROMPT_GROUP = "prompt_group"  # a failure redoes the whole group
    SIBLING = "sibling"  # a failure redoes only that sibling


ATTEMPT_TRANSITIONS: dict[tuple[AttemptState, AttemptEvent], AttemptState] = {
    (AttemptState.RESERVED, AttemptEvent.DISPATCH): AttemptState.DISPATCHED,
    (AttemptState.RESERVED, AttemptEvent.ABANDON): AttemptState.ABANDONED,
    (AttemptState.DISPATCHED, AttemptEvent.RECEIVE): AttemptState.SEALING,
    (AttemptState.DISPATCHED, AttemptEvent.SEAL): AttemptState.SEALED,
    (AttemptState.DISPATCHED, AttemptEvent.FAIL): AttemptState.FAILED,
    (AttemptState.DISPATCHED, AttemptEvent.ABANDON): AttemptState.ABANDONED,
    (AttemptState.SEALING, AttemptEvent.SEAL): AttemptState.SEALED,
    (AttemptState.SEALING, AttemptEvent.FAIL): AttemptState.FAILED,  # TQ refused its seal
    (AttemptState.SEALING, AttemptEvent.ABANDON): AttemptState.ABANDONED,  # prompt_group redo
    (AttemptState.SEALED, AttemptEvent.ABANDON): AttemptState.ABANDONED,  # prompt_group discards it
    (AttemptState.ABANDONED, AttemptEvent.RETIRE): AttemptState.RETIRED,
}

GROUP_TRANSITIONS: dict[tuple[GroupState, GroupEvent], GroupState] = {
    (GroupState.GENERATING, GroupEvent.SETTLE): GroupState.READY_TO_FINALIZE,
    (GroupState.READY_TO_FINALIZE, GroupEvent.FINALIZE): GroupState.FINALIZING,
    (GroupState.GENERATING, GroupEvent.REOPEN): GroupState.GENERATING,
}


@dataclass
class Attempt:
    index: int
    capture_key: str
    state: AttemptState = AttemptState.RESERVED
    replica: int | None = None
    reward: float | None = None
    turns: int = 0
    failure: str | None = None
    continue_from: int | None = None  # after a restore: the saved attempt this one continues
    # The policy replica its calls go to, when not the one its rollout id hashes to: after a restore
    # onto another number of them, the replica that took over the saved prefix (protocol/placement.py).
    policy: int | None = None
    # While SEALING (and once SEALED): the staging rows its receipt named, which a seal made again
    # after a restore needs (empty: the rows of its own capture key, in turn order).
    staging_keys: tuple[str, ...] = ()

    def move(self, event: AttemptEvent) -> None:
        after = ATTEMPT_TRANSITIONS.get((self.state, event))
        if after is None:
            raise LedgerError(
                f"attempt {self.capture_key}: {event.value} is illegal in state {self.state.value}"
            )
        self.state = after


@dataclass
class Sibling:
    rollout_id: str
    generation_index: int
    attempts: list[Attempt] = field(default_factory=list)
    given_up: bool = False  # failed max_attempts times: a typed failure result, never a fake sample

    @property
    def current(self) -> Attempt:
        return self.attempts[-1]

    @property
    def settled(self) -> bool:
        return self.given_up or (bool(self.attempts) and self.current.state is AttemptState.SEALED)


@dataclass
class Group:
    group_id: str
    task_index: int
    granularity: Granularity
    siblings: list[Sibling]
    state: GroupState = GroupState.GENERATING
    redos: int = 0  # times a failure sent the whole group back to its prompt (restores do not count)

    def move(self, event: GroupEvent) -> None:
        after = GROUP_TRANSITIONS.get((self.state, event))
        if after is None:
            raise LedgerError(f"group {self.group_id}: {event.value} is illegal in state {self.state.value}")
        self.state = after


# The states the ledger keeps an index of (``Ledger._live``): what runs, what is being sealed, and what
# was given up on and may still run on an agent (retired at every snapshot's first step).
_INDEXED = (AttemptState.DISPATCHED, AttemptState.SEALING, AttemptState.ABANDONED)
# A prompt_group redo abandons every sibling's current attempt but the failed and the given up.
_ABANDONABLE = (AttemptState.RESERVED, AttemptState.DISPATCHED, AttemptState.SEALING, AttemptState.SEALED)


class SealOutcome(StrEnum):
    SEALED = "sealed"
    DUPLICATE = "duplicate"  # this attempt was sealed before: acknowledge again, change nothing
    STALE = "stale"  # an attempt that is no longer current (abandoned, retired, replaced)


@dataclass(frozen=True)
class FailurePlan:
    """What a failure leads to: attempts to reserve and dispatch anew, attempts to retire on agents."""

    redo: tuple[str, ...] = ()  # rollout ids that get a new attempt
    retire: tuple[tuple[str, int, int], ...] = ()  # (rollout id, attempt, replica) still running somewhere
    given_up: tuple[str, ...] = ()  # rollout ids that failed for good
    stale: bool = False


class Ledger:
    def __init__(self, *, max_attempts: int = 3) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.max_attempts = max_attempts
        self.groups: dict[str, Group] = {}
        self._siblings: dict[str, tuple[Group, Sibling]] = {}
        # The attempts running, sealing and abandoned, kept at every move: a snapshot's steps and each
        # dispatch ask for them, and a scan of the whole ledger each time grew with the rollouts in flight.
        self._live: dict[AttemptState, dict[tuple[str, int], tuple[Sibling, Attempt]]] = {
            state: {} for state in _INDEXED
        }
        # Each running attempt's place in the order of dispatches: a snapshot's instant notes only how
        # many there were (``dispatch_mark``), and the attempts running at it are read off after.
        self._dispatches = 0
        self._dispatch_order: dict[tuple[str, int], int] = {}
        # Each group as the last export encoded it, and the groups changed since: a snapshot copies the
        # ledger at its capture, and encodes again only the groups that moved, not every one held.
        # (So every change goes through a method here: one made from outside is not seen by ``export``.)
        self._encoded: dict[str, msgspec.Raw] = {}
        self._changed: set[str] = set()

    # -- building --------------------------------------------------------------------------------
    def add_group(self, group_id: str, task_index: int, size: int, granularity: Granularity) -> Group:
        if group_id in self.groups:
            raise LedgerError(f"group {group_id} exists")
        siblings = [Sibling(rollout_id(group_id, i), i) for i in range(size)]
        group = Group(group_id, task_index, granularity, siblings)
        self.groups[group_id] = group
        self._changed.add(group_id)
        for sibling in siblings:
            self._siblings[sibling.rollout_id] = (group, sibling)
            self._new_attempt(sibling)
        return group

    def _new_attempt(self, sibling: Sibling) -> Attempt:
        index = len(sibling.attempts)
        attempt = Attempt(index, capture_key(sibling.rollout_id, index))
        sibling.attempts.append(attempt)
        self._touch(sibling.rollout_id)
        return attempt

    def sibling(self, rollout: str) -> Sibling:
        try:
            return self._siblings[rollout][1]
        except KeyError:
            raise LedgerError(f"unknown rollout {rollout}") from None

    def group_of(self, rollout: str) -> Group:
        return self._siblings[rollout][0]

    def knows(self, rollout: str) -> bool:
        return rollout in self._siblings

    # -- transitions -----------------------------------------------------------------------------
    def reserved(self) -> list[Sibling]:
        """Siblings whose current attempt waits for dispatch, in group then sibling order."""
        return [
            s
            for g in self.groups.values()
            for s in g.siblings
            if not s.given_up and s.current.state is AttemptState.RESERVED
        ]

    def dispatch(self, rollout: str, attempt: int, replica: int) -> Attempt:
        current = self._current(rollout, attempt)
        self._move(self.sibling(rollout), current, AttemptEvent.DISPATCH)
        current.replica = replica
        return current

    def receive(
        self, rollout: str, attempt: int, *, reward: float, turns: int, staging_keys: tuple[str, ...] = ()
    ) -> SealOutcome:
        """The attempt's receipt arrived: SEALING until ``seal``, with what a seal needs. SEALED here
        means it moved to SEALING (a receipt of an attempt already SEALING is a DUPLICATE)."""
        target = self._receipt_target(rollout, attempt)
        if target.state in (AttemptState.SEALED, AttemptState.SEALING):
            return SealOutcome.DUPLICATE
        if target is not self.sibling(rollout).current or target.state is not AttemptState.DISPATCHED:
            return SealOutcome.STALE
        self._move(self.sibling(rollout), target, AttemptEvent.RECEIVE)
        target.reward, target.turns, target.staging_keys = reward, turns, staging_keys
        return SealOutcome.SEALED

    def seal(self, rollout: str, attempt: int, *, reward: float, turns: int) -> SealOutcome:
        target = self._receipt_target(rollout, attempt)
        if target.state is AttemptState.SEALED:
            return SealOutcome.DUPLICATE
        if target is not self.sibling(rollout).current or target.state not in (
            AttemptState.DISPATCHED,
            AttemptState.SEALING,
        ):
            return SealOutcome.STALE
        self._move(self.sibling(rollout), target, AttemptEvent.SEAL)
        target.reward, target.turns = reward, turns
        self._settle_if_done(self.group_of(rollout))
        return SealOutcome.SEALED

    def _receipt_target(self, rollout: str, attempt: int) -> Attempt:
        sibling = self.sibling(rollout)
        if not 0 <= attempt < len(sibling.attempts):  # (a negative index would pick the current one)
            raise LedgerError(f"receipt for {rollout} attempt {attempt}, which was never reserved")
        return sibling.attempts[attempt]

    def fail(self, rollout: str, attempt: int, *, code: str, turns: int = 0) -> FailurePlan:
        """A failed attempt, DISPATCHED (its agent's receipt, the watchdog) or SEALING (TQ refused its
        seal, or the seal never came back); anything else is stale."""
        group, sibling = self._siblings[rollout]
        target = sibling.attempts[attempt] if 0 <= attempt < len(sibling.attempts) else None
        if (
            target is None
            or target is not sibling.current
            or target.state not in (AttemptState.DISPATCHED, AttemptState.SEALING)
        ):
            return FailurePlan(stale=True)
        self._move(sibling, target, AttemptEvent.FAIL)
        target.failure, target.turns = code, turns
        if group.granularity is Granularity.SIBLING:
            # Failures count, not attempts: a restore or a lost agent gives a rollout a new attempt
            # without it having failed, and must not use up its retries.
            if sum(a.state is AttemptState.FAILED for a in sibling.attempts) >= self.max_attempts:
                sibling.given_up = True
                self._settle_if_done(group)
                return FailurePlan(given_up=(rollout,))
            self._new_attempt(sibling)
            return FailurePlan(redo=(rollout,))
        # prompt_group: every sibling starts over; running ones are retired on their agents.
        if group.redos + 1 >= self.max_attempts:
            for s in group.siblings:
                s.given_up = True
            retire = self._abandon_all(group)
            self._settle_if_done(group)
            return FailurePlan(retire=retire, given_up=tuple(s.rollout_id for s in group.siblings))
        retire = self._abandon_all(group)
        group.redos += 1
        group.move(GroupEvent.REOPEN)
        for s in group.siblings:
            self._new_attempt(s)
        return FailurePlan(redo=tuple(s.rollout_id for s in group.siblings), retire=retire)

    def _abandon_all(self, group: Group) -> tuple[tuple[str, int, int], ...]:
        running = []
        for s in group.siblings:
            current = s.current
            if current.state is AttemptState.DISPATCHED:
                assert current.replica is not None
                running.append((s.rollout_id, current.index, current.replica))
            if current.state in _ABANDONABLE:
                self._move(s, current, AttemptEvent.ABANDON)
        return tuple(running)

    def retired(self, rollout: str, attempt: int) -> None:
        """The agent confirmed it stopped an abandoned attempt."""
        sibling = self.sibling(rollout)
        target = sibling.attempts[attempt]
        if target.state is AttemptState.ABANDONED:
            self._move(sibling, target, AttemptEvent.RETIRE)

    def _settle_if_done(self, group: Group) -> None:
        if group.state is GroupState.GENERATING and all(s.settled for s in group.siblings):
            group.move(GroupEvent.SETTLE)
            self._changed.add(group.group_id)

    def ready_groups(self) -> list[Group]:
        return [g for g in self.groups.values() if g.state is GroupState.READY_TO_FINALIZE]

    def finalize(self, group_id: str) -> Group:
        group = self.groups[group_id]
        group.move(GroupEvent.FINALIZE)
        self._changed.add(group_id)
        return group

    def remove(self, group_id: str) -> Group:
        group = self.groups.pop(group_id)
        if group.state is not GroupState.FINALIZING:
            raise LedgerError(f"group {group_id} removed in state {group.state.value}")
        self._encoded.pop(group_id, None)
        self._changed.discard(group_id)
        for s in group.siblings:
            del self._siblings[s.rollout_id]
            for a in s.attempts:
                for live in self._live.values():
                    live.pop((s.rollout_id, a.index), None)
                self._dispatch_order.pop((s.rollout_id, a.index), None)
        return group

    def _current(self, rollout: str, attempt: int) -> Attempt:
        sibling = self.sibling(rollout)
        if sibling.current.index != attempt:
            raise LedgerError(f"{rollout}: attempt {attempt} is not current ({sibling.current.index})")
        return sibling.current

    def _move(self, sibling: Sibling, attempt: Attempt, event: AttemptEvent) -> None:
        """Every attempt's move goes through here: the index follows, and the group is encoded again at
        the next export (with the fields the calling method sets next to the move)."""
        before = attempt.state
        attempt.move(event)
        if before in self._live:
            del self._live[before][(sibling.rollout_id, attempt.index)]
        if before is AttemptState.DISPATCHED:
            del self._dispatch_order[(sibling.rollout_id, attempt.index)]
        self._track(sibling, attempt)
        self._touch(sibling.rollout_id)

    def _touch(self, rollout: str) -> None:
        """The rollout's group changed: the next export encodes it again."""
        self._changed.add(self._siblings[rollout][0].group_id)

    def _track(self, sibling: Sibling, attempt: Attempt) -> None:
        """Index the attempt under its state, when that state is one the ledger keeps an index of."""
        if attempt.state in self._live:
            self._live[attempt.state][(sibling.rollout_id, attempt.index)] = (sibling, attempt)
        if attempt.state is AttemptState.DISPATCHED:
            self._dispatches += 1
            self._dispatch_order[(sibling.rollout_id, attempt.index)] = self._dispatches

    # -- restore -----------------------------------------------------------------------------------
    def restart_after_restore(
        self, rollout: str, *, continue_saved: bool, replica: int | None = None
    ) -> Attempt:
        """A rollout that was running at the snapshot gets attempt N+1 on the same replica (or on
        ``replica``, when the restore has another number of agents): continuing its saved transcript
        (turn level) or from its prompt (sibling level). Attempt N is fenced."""
        sibling = self.sibling(rollout)
        saved = sibling.current
        if saved.state is not AttemptState.DISPATCHED:
            raise LedgerError(
                f"{rollout}: only a dispatched attempt is restarted, not one {saved.state.value}"
            )
        self._move(sibling, saved, AttemptEvent.ABANDON)
        self._move(
            sibling, saved, AttemptEvent.RETIRE
        )  # nothing runs it any more: the cluster it ran in is gone
        attempt = self._new_attempt(sibling)
        attempt.replica = saved.replica if replica is None else replica
        attempt.continue_from = saved.index if continue_saved else None
        return attempt

    def redo_group_after_restore(self, group_id: str, *, agents: int | None = None) -> None:
        """``prompt_group`` recovery: every sibling of the group starts over, sealed ones included, on
        its replica (on any, when that replica is not among the live ``agents``)."""
        group = self.groups[group_id]
        for sibling in group.siblings:
            current = sibling.current
            if current.state in _ABANDONABLE:
                self._move(sibling, current, AttemptEvent.ABANDON)
                self._move(sibling, current, AttemptEvent.RETIRE)
                replica = current.replica
                if agents is not None and replica is not None and replica >= agents:
                    replica = None  # the dispatcher places it
                self._new_attempt(sibling).replica = replica
        # Not a failure: ``redos`` counts the group's failures against ``max_attempts``.

    def place_on_policy(self, rollout: str, policy: int) -> None:
        """After a restore onto another number of policy replicas: the replica the current attempt's
        calls go to (the one that took over its saved prefix)."""
        self.sibling(rollout).current.policy = policy
        self._touch(rollout)

    def dispatched(self) -> set[tuple[str, int]]:
        """Attempts running on their agents (not SEALING: those finished there)."""
        return set(self._live[AttemptState.DISPATCHED])

    def running(self) -> Mapping[tuple[str, int], tuple[Sibling, Attempt]]:
        """The attempts running on their agents, as a read-only view of the ledger's own index (no
        copy)."""
        return MappingProxyType(self._live[AttemptState.DISPATCHED])

    def dispatch_mark(self) -> int:
        """How many times an attempt was dispatched so far (constant time): a snapshot's instant notes
        it, and the attempts running later are told apart by it (``dispatched_by``, ``dispatched_after``)."""
        return self._dispatches

    def dispatched_by(self, mark: int) -> set[tuple[str, int]]:
        """The attempts running now that were dispatched by ``mark`` (``dispatch_mark``)."""
        return {key for key, n in self._dispatch_order.items() if n <= mark}

    def dispatched_after(self, mark: int) -> set[tuple[str, int]]:
        """The attempts running now that were dispatched after ``mark``."""
        return {key for key, n in self._dispatch_order.items() if n > mark}

    def dispatched_attempts(self) -> list[tuple[Sibling, Attempt]]:
        """The attempts running on their agents, with their rollouts, in the order they were dispatched
        (in ledger order after a load)."""
        return list(self._live[AttemptState.DISPATCHED].values())

    def sealing(self) -> list[tuple[Sibling, Attempt]]:
        """Attempts whose receipt arrived and whose seal has not come back, in the order they arrived
        (in ledger order after a load)."""
        return list(self._live[AttemptState.SEALING].values())

    def abandoned(self) -> list[tuple[Sibling, Attempt]]:
        """Attempts given up on and not yet retired (their agent may still run them), in the order they
        were abandoned (in ledger order after a load)."""
        return list(self._live[AttemptState.ABANDONED].values())

    # -- persistence ---------------------------------------------------------------------------------
    def export(self) -> bytes:
        """The whole ledger, encoded. A group unchanged since the last export is not encoded again: its
        bytes are reused (the result is the same bytes as encoding every group)."""
        for group_id in self._changed:
            self._encoded[group_id] = msgspec.Raw(msgspec.msgpack.encode(self.groups[group_id]))
        self._changed.clear()
        return msgspec.msgpack.encode(
            {"max_attempts": self.max_attempts, "groups": [self._encoded[g] for g in self.groups]}
        )

    @classmethod
    def load(cls, data: bytes) -> Ledger:
        decoded = msgspec.msgpack.decode(data, type=_LedgerRecord)
        ledger = cls(max_attempts=decoded.max_attempts)
        for group in decoded.groups:
            ledger.groups[group.group_id] = group
            for sibling in group.siblings:
                ledger._siblings[sibling.rollout_id] = (group, sibling)
                for attempt in sibling.attempts:
                    ledger._track(sibling, attempt)
        ledger._changed.update(ledger.groups)
        return ledger

    # -- views ------------------------------------------------------------------------------------
    def attempts(self) -> list[tuple[Sibling, Attempt]]:
        return [(s, a) for g in self.groups.values() for s in g.siblings for a in s.attempts]

    def in_flight(self) -> int:
        """Attempts dispatched and not settled (SEALING included: their rows are still being made). A
        reserved attempt waiting for the gate is not running."""
        return len(self._live[AttemptState.DISPATCHED]) + len(self._live[AttemptState.SEALING])


class _LedgerRecord(msgspec.Struct):
    max_attempts: int
    groups: list[Group]
