"""The controller's save and restore sequences as data.

The controller walks these tuples, in this order, with the stages given here: each step has one
implementation (``actors/roles/controller/save.py`` and ``restore.py`` map every step to it, and
refuse to import when a step has none or one too many). Where a failure still aborts is read from
here too: ``save_failure_aborts`` and ``restore_failure_aborts``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from parkway.protocol.ids import Role


class SaveStep(StrEnum):
    # Before the window: what the agents' cuts need not hold.
    RETIRE = "retire"  # attempts given up on are stopped on their agents
    ACK_DRAIN = "ack_drain"  # every pending ACK goes out, as one batch per agent
    # The admission-closed window: only the cut's instant, one stretch of the event loop with no await
    # (skipped when nothing moved since the last snapshot: checked first, with admission open).
    INSTANT = "instant"  # gate closed, the ledger's count of dispatches noted, gate open
    # After the window, with the rollouts running: nothing here holds them but the rollouts of an
    # environment without round copies, and a failure here aborts this snapshot (the one before stays
    # authoritative), never the run. A Run dispatched from here on is after the cut: in it if its
    # agent cut it, started from its prompt by a restore otherwise.
    PREPARE = "prepare"  # every agent's Prepare: the Runs dispatched to it by the instant
    PREPARED = "prepared"  # every agent's cut comes back: its rollouts at their boundaries
    DRAIN_RECEIPTS = "drain_receipts"  # receipts of attempts no cut holds arrive before the copy
    CAPTURE = "capture"  # the ledger copied, and TQ's Prepare and Commit sent behind its data: one cut
    COMMIT = "commit"  # every other participant takes its cut (a tool server at its agents' boundaries)
    RESUME = "resume"  # participants resume (retried under the same id until all answer)
    PERSIST = "persist"  # every participant writes its cut under tmp_<id>; the ledger is written
    VALIDATE = "validate"  # saved episodes == dispatched attempts, staging keys present, digests match
    PUBLISH = "publish"  # fsync, rename tmp_<id> to snapshot_<seq>, fsync the parent; prune the oldest


class RestoreStep(StrEnum):
    END_ORPHANS = "end_orphans"  # abort what a controller that died mid-snapshot left prepared
    SELECT = "select"  # the newest snapshot whose manifest and digests verify (or a trainer fallback)
    DISCOVER = "discover"  # the live topology must match the snapshot's
    RESTORE_LEDGER = "restore_ledger"  # check the saved episodes against it, then adopt it
    # Agents first: they stop whatever fresh processes picked up from the dead cluster's queues.
    RESTORE_PARTICIPANTS = "restore_participants"  # while paused; attempt N+1 on the same replica
    FENCE_PARTICIPANTS = "fence_participants"  # the attempts the snapshot had running, everywhere
    RESTORE_TQ = "restore_tq"  # last: nothing generated before the fence survives in it
    FENCE_TQ = "fence_tq"  # after TQ's restore, which drops the fences it had
    RESUME = "resume"  # exactly once, by one owner
    # The attempts whose receipts the ledger saved while their seal was on its way (SEALING): TQ makes
    # their canonical rows again (idempotent), the ledger seals them, their agents get the Ack.
    FINISH_SEALS = "finish_seals"
    OPEN_GATE = "open_gate"


StepName = TypeVar("StepName", SaveStep, RestoreStep)

Stage = tuple[Role, ...]  # the roles asked at once


def stages(*names: str) -> tuple[Stage, ...]:
    """Stages written as role names, several asked at once joined by "+": ``stages("agent", "resources+tq")``."""
    return tuple(tuple(Role(role) for role in name.split("+")) for name in names)


def stage_name(stage: Stage) -> str:
    """A stage as it is written (``resources+tq``): in fault points and messages."""
    return "+".join(stage)


@dataclass(frozen=True)
class Step(Generic[StepName]):
    name: StepName
    # Stages in the order they are asked; the members of a stage are asked at once. A stage is one role,
    # or several (resources and TQ: TQ has nothing to park or release, so it needs no stage of its own,
    # and a stage costs a round trip to the slowest of its members).
    stages: tuple[Stage, ...] = ()


EVERY_PARTICIPANT = stages("agent+policy+resources+tq")

SAVE_SEQUENCE: tuple[Step[SaveStep], ...] = (
    Step(SaveStep.RETIRE),
    Step(SaveStep.ACK_DRAIN),
    # The window is the instant alone: what was dispatched by then is the cut's, and nothing is made,
    # sent or waited for with admission closed. Only the agents cut at their rollouts' boundaries; the
    # other roles hold nothing a rollout waits on, so they are prepared and committed after, each in
    # one go (they park at once: a Commit right behind the Prepare finds it prepared). TQ's come at the
    # capture, on its data lane: behind the rows the agents' cuts refer to, and at the ledger's instant.
    Step(SaveStep.INSTANT),
    Step(SaveStep.PREPARE, stages("agent")),
    Step(SaveStep.PREPARED, stages("agent")),
    Step(SaveStep.DRAIN_RECEIPTS),
    Step(SaveStep.CAPTURE, stages("tq")),
    Step(SaveStep.COMMIT, stages("agent+policy+resources")),
    Step(SaveStep.RESUME, EVERY_PARTICIPANT),
    Step(SaveStep.PERSIST, EVERY_PARTICIPANT),
    Step(SaveStep.VALIDATE),
    Step(SaveStep.PUBLISH),
)

# Where a failure no longer aborts: the cut was taken and is released (the rollouts run on from it
# either way). A failure at any other step aborts the snapshot under its id, and the one before stays
# authoritative (a publish that fails undoes its rename).
NOT_ABORTED = frozenset({SaveStep.RESUME})
# The window begins and ends here (one step): the steps before and after it run with admission open.
WINDOW_BEGINS, WINDOW_ENDS = SaveStep.INSTANT, SaveStep.INSTANT

RESTORE_SEQUENCE: tuple[Step[RestoreStep], ...] = (
    Step(RestoreStep.END_ORPHANS, stages("agent", "policy", "resources", "tq")),
    Step(RestoreStep.SELECT),
    Step(RestoreStep.DISCOVER, stages("agent", "policy", "resources", "tq")),
    Step(RestoreStep.RESTORE_LEDGER),
    Step(RestoreStep.RESTORE_PARTICIPANTS, stages("agent", "policy", "resources")),
    Step(RestoreStep.FENCE_PARTICIPANTS, stages("agent", "policy", "resources")),
    Step(RestoreStep.RESTORE_TQ, stages("tq")),
    Step(RestoreStep.FENCE_TQ, stages("tq")),
    Step(RestoreStep.RESUME, stages("resources", "policy", "agent", "tq")),
    Step(RestoreStep.FINISH_SEALS),
    Step(RestoreStep.OPEN_GATE),
)

# Participants hold the restore's id from its first Restore until they resume: a failure in between
# aborts that id everywhere, once, by this controller (and nothing resumes). Before it nothing was
# sent under the id; the resume itself retries until every participant answered.
RESTORE_ABORTABLE = (RestoreStep.RESTORE_PARTICIPANTS, RestoreStep.FENCE_TQ)


def _position(sequence: tuple[Step[StepName], ...], name: StepName) -> int:
    return [step.name for step in sequence].index(name)


def save_failure_aborts(failed_at: SaveStep) -> bool:
    """Whether a save that failed at this step is aborted (its participants, its temporary files)."""
    return failed_at not in NOT_ABORTED


def in_window(step: SaveStep) -> bool:
    """Whether ``step`` runs while admission is closed."""
    at = _position(SAVE_SEQUENCE, step)
    return _position(SAVE_SEQUENCE, WINDOW_BEGINS) <= at <= _position(SAVE_SEQUENCE, WINDOW_ENDS)


def restore_failure_aborts(failed_at: RestoreStep) -> bool:
    """Whether a restore that failed at this step aborts its id on every participant."""
    first, last = (_position(RESTORE_SEQUENCE, step) for step in RESTORE_ABORTABLE)
    return first <= _position(RESTORE_SEQUENCE, failed_at) <= last


class SnapshotFailure(Exception):
    """A snapshot attempt failed. ``transient`` failures are retried at the next interval."""

    def __init__(self, step: str, detail: str, *, transient: bool) -> None:
        super().__init__(f"{step}: {detail}")
        self.step = step
        self.detail = detail
        self.transient = transient


def episode_mismatch(
    saved: set[tuple[str, int]], dispatched: set[tuple[str, int]], limit: int = 20
) -> str | None:
    """None when the sets agree; else a message naming the differing (rollout, attempt) pairs."""
    missing = sorted(dispatched - saved)
    extra = sorted(saved - dispatched)
    if not missing and not extra:
        return None

    def names(pairs: list[tuple[str, int]]) -> str:
        shown = ", ".join(f"{r}@{a}" for r, a in pairs[:limit])
        return shown + (f" and {len(pairs) - limit} more" if len(pairs) > limit else "")

    parts = []
    if missing:
        parts.append(f"dispatched but not saved: {names(missing)}")
    if extra:
        parts.append(f"saved but not dispatched: {names(extra)}")
    return "; ".join(parts)


def check_step_table(sequence: tuple[Step[StepName], ...], implemented: Iterable[StepName]) -> None:
    """Raise ``TypeError`` unless ``sequence`` names every step of its kind exactly once and
    ``implemented`` (the keys of a step table) has every one of them and nothing else. Called where a
    table is defined, so that a step without its implementation cannot even be imported."""
    kind = type(sequence[0].name)
    names = [step.name for step in sequence]
    problems = []
    if sorted(names) != sorted(kind) or len(set(names)) != len(names):
        problems.append(f"the sequence names {names}, not every {kind.__name__} once")
    have = list(implemented)  # compared by identity: a StrEnum member equals its value's string
    if missing := [n.value for n in kind if not any(h is n for h in have)]:
        problems.append(f"no implementation of {', '.join(missing)}")
    if extra := [str(h) for h in have if not isinstance(h, kind)]:
        problems.append(f"implementations of no {kind.__name__}: {', '.join(extra)}")
    if problems:
        raise TypeError(f"{kind.__name__} table: " + "; ".join(problems))
