"""The controller's save and restore sequences as data (SPEC sections 6 and 7).

The coordinator (``actors/roles/controller/snapshots.py``) walks these tuples; each step is implemented in one place
there, and the order, the stages and where an abort is still possible are read from here, not
scattered across handlers. A failure at a step before ``PUBLISH`` aborts the snapshot under its id.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class SaveStep(StrEnum):
    CLOSE_GATE = "close_gate"  # stop dispatching Run; rows waiting behind the gate are not running
    RETIRE = "retire"  # attempts given up on are stopped on their agents
    ACK_DRAIN = "ack_drain"  # every pending ACK goes out, as one batch per agent
    PREPARE = "prepare"  # participants park, staged, event driven, one deadline for all
    COMMIT = "commit"  # participants write their records under the snapshot's temporary directory
    DRAIN_RECEIPTS = "drain_receipts"  # receipts already on the wire seal before the cut
    CAPTURE = "capture"  # TQ, ledger and task cursor at one cut
    VALIDATE = "validate"  # saved episodes == dispatched attempts, staging keys present, digests match
    PUBLISH = "publish"  # fsync, rename tmp_<id> to snapshot_<seq>, fsync the parent, keep the newest k
    RESUME = "resume"  # participants resume (retried under the same id until all answer)
    OPEN_GATE = "open_gate"


@dataclass(frozen=True)
class Step:
    name: StrEnum  # a SaveStep or a RestoreStep
    # Stages in the order they are asked; the members of a stage are asked at once. A stage is a role,
    # or roles joined by "+" ("resources+tq": TQ has nothing to park or release, so it needs no stage
    # of its own, and a stage costs a round trip to the slowest of its members).
    stages: tuple[str, ...] = ()


SAVE_SEQUENCE: tuple[Step, ...] = (
    Step(SaveStep.CLOSE_GATE),
    Step(SaveStep.RETIRE),
    Step(SaveStep.ACK_DRAIN),
    Step(SaveStep.PREPARE, ("policy", "agent", "resources+tq")),
    Step(SaveStep.COMMIT, ("agent", "policy", "resources")),
    Step(SaveStep.DRAIN_RECEIPTS),
    Step(SaveStep.CAPTURE, ("tq",)),
    Step(SaveStep.VALIDATE),
    Step(SaveStep.PUBLISH),
    Step(SaveStep.RESUME, ("resources+tq", "policy", "agent")),
    Step(SaveStep.OPEN_GATE),
)

# Up to (not including) this step a failure aborts the snapshot and the previous one stays authoritative.
ABORTABLE_UNTIL = SaveStep.PUBLISH


class RestoreStep(StrEnum):
    SELECT = "select"  # the newest snapshot whose manifest and digests verify
    DISCOVER = "discover"  # the live topology must match the snapshot's
    RESTORE_TQ = "restore_tq"
    RESTORE_LEDGER = "restore_ledger"  # then check the saved episodes against it
    RESTORE_PARTICIPANTS = "restore_participants"  # while paused; attempt N+1 on the same replica
    RESUME = "resume"  # exactly once, by one owner
    OPEN_GATE = "open_gate"


RESTORE_SEQUENCE: tuple[Step, ...] = (
    Step(RestoreStep.SELECT),
    Step(RestoreStep.DISCOVER),
    Step(RestoreStep.RESTORE_TQ, ("tq",)),
    Step(RestoreStep.RESTORE_LEDGER),
    Step(RestoreStep.RESTORE_PARTICIPANTS, ("agent", "policy", "resources")),
    Step(RestoreStep.RESUME, ("resources", "policy", "agent", "tq")),
    Step(RestoreStep.OPEN_GATE),
)


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
