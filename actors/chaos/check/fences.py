"""``fenced_attempts_stay_fenced``: once attempt N+1 of a rollout exists, nothing of attempt N is
accepted anywhere."""

from __future__ import annotations

from parkway.actors.chaos.check.about import attempt_of
from parkway.actors.chaos.check.verdict import CheckResult, Violation
from parkway.protocol.history import (
    Dispatched,
    GenerationFinished,
    GenerationStarted,
    LedgerCaptured,
    MutationApplied,
    Record,
    RestoreFenced,
    RolloutSealed,
    RowSealed,
    RowStaged,
    RunReceived,
    RunStarted,
    SessionOpened,
    SessionVerified,
    Started,
)
from parkway.protocol.ids import Role

# Records that mean "a message of attempt (r, a) was accepted, acted on", and the role that accepts it.
ACCEPTANCES: dict[type[Record], Role] = {
    RolloutSealed: Role.CONTROLLER,
    RunReceived: Role.AGENT,
    GenerationStarted: Role.POLICY,
    GenerationFinished: Role.POLICY,
    SessionOpened: Role.RESOURCES,
    MutationApplied: Role.RESOURCES,
    SessionVerified: Role.RESOURCES,
    RowStaged: Role.TQ,
    RowSealed: Role.TQ,
}


def check_fenced_attempts(records: list[Record]) -> CheckResult:
    """One sweep in time order over the timeline that is live: a dispatch of attempt N+1 (or a restore's
    fence of N) supersedes N; an acceptance of a superseded attempt is a violation. A restore rolls the
    timeline back to its snapshot: what the dead controller dispatched after that snapshot's capture
    no longer exists (the restored ledger gives those numbers out again). Between a controller's death
    and the next restore's fence nothing is judged: the restore stops and fences what ran meanwhile."""
    result = CheckResult("fenced_attempts_stay_fenced", "")
    captured_at = {
        r.checkpoint_id: r.t for r in records if r.role == Role.CONTROLLER and isinstance(r, LedgerCaptured)
    }
    superseded: dict[tuple[str, int], Record] = {}  # (rollout, attempt) -> the record that superseded it
    controller: str | None = None  # the incarnation whose timeline is live; None between two
    accepted = fenced = 0

    def supersede(rollout: str, attempt: int, record: Record) -> None:
        for older in range(attempt):
            superseded.setdefault((rollout, older), record)

    for record in records:
        if record.role == Role.CONTROLLER:
            if isinstance(record, Started):
                controller = None  # a new controller: the old timeline is over, the new one not yet set
            elif isinstance(record, RestoreFenced):
                cut = captured_at.get(record.saved_checkpoint_id, record.t)
                superseded = {k: v for k, v in superseded.items() if v.t <= cut}
                for rollout, attempt in record.attempts:
                    supersede(rollout, attempt + 1, record)
                controller, fenced = record.inc, fenced + 1
            elif isinstance(record, RunStarted) and not record.restored:
                superseded, controller = {}, record.inc  # a fresh ledger
            elif isinstance(record, Dispatched) and record.inc == controller:
                supersede(record.rollout_id, record.attempt, record)
            if not isinstance(record, RolloutSealed) or record.inc != controller:
                continue  # of the controller's records only its seals accept something
        if ACCEPTANCES.get(type(record)) != record.role or controller is None:
            continue
        if isinstance(record, RunReceived) and record.outcome != "accepted":
            continue
        about = attempt_of(record)
        if about is None:
            continue
        accepted += 1
        newer = superseded.get(about)
        if newer is not None and record.t > newer.t:
            result.violations.append(
                Violation(
                    "fenced_attempts_stay_fenced",
                    f"{record.actor} accepted {record.kind} of {about[0]} attempt {about[1]} "
                    f"{record.t - newer.t:.3f}s after a newer attempt existed ({newer.kind} by the controller)",
                    [newer, record],
                    about[0],
                )
            )
    result.detail = (
        f"{accepted} acceptances checked against {len(superseded)} superseded attempts, "
        f"{fenced} restores rolled the timeline back"
    )
    return result
