"""``no_turn_regenerated`` and ``mutations_exactly_once``: what a turn did happened once, whatever the
crashes: a saved model call is never generated again, a tool mutation never applied twice or lost."""

from __future__ import annotations

from parkway.actors.chaos.check.timeline import Incarnation, incarnations, surviving_seals
from parkway.actors.chaos.check.verdict import CheckResult, Violation
from parkway.protocol.history import (
    ContinuationRestored,
    GenerationStarted,
    ModelCallSent,
    MutationApplied,
    Record,
    SessionOpened,
    SessionRestored,
    SessionVerified,
)
from parkway.protocol.ids import Role


def check_no_turn_regenerated(records: list[Record]) -> CheckResult:
    result = CheckResult("no_turn_regenerated", "")
    continuations: dict[tuple[str, int], ContinuationRestored] = {}
    for record in records:
        if record.role == Role.AGENT and isinstance(record, ContinuationRestored):
            continuations[(record.rollout_id, record.attempt)] = record
    calls = 0
    for record in records:
        asked = record.role == Role.AGENT and isinstance(record, ModelCallSent)
        generated = record.role == Role.POLICY and isinstance(record, GenerationStarted)
        if not (asked or generated):
            continue
        assert isinstance(record, ModelCallSent | GenerationStarted)
        key = (record.rollout_id, record.attempt)
        continuation = continuations.get(key)
        if continuation is None or record.t < continuation.t:
            continue
        calls += 1
        kept = continuation.kept_model
        if record.call_index < kept:
            who = "asked for" if asked else "generated"
            result.violations.append(
                Violation(
                    "no_turn_regenerated",
                    f"{key[0]} attempt {key[1]} continued from {kept} saved model calls, yet "
                    f"{record.actor} {who} call {record.call_index} again",
                    [continuation, record],
                    key[0],
                )
            )
    result.detail = (
        f"{len(continuations)} rollouts continued after a restore, {calls} of their model calls checked"
    )
    return result


def check_mutations_exactly_once(records: list[Record], controllers: list[Incarnation]) -> CheckResult:
    result = CheckResult("mutations_exactly_once", "")
    mutations = 0
    # (a) within each resources process: a session never applies one call index twice.
    for process in incarnations(records, Role.RESOURCES):
        sessions: dict[str, tuple[int, dict[int, Record]]] = {}
        for record in process.records:
            if isinstance(record, SessionOpened):
                sessions[record.rollout_id] = (record.attempt, {})
            elif isinstance(record, SessionRestored):
                sessions[record.rollout_id] = (record.attempt, dict.fromkeys(record.applied, record))
            elif isinstance(record, MutationApplied):
                mutations += 1
                rollout, attempt, index = record.rollout_id, record.attempt, record.call_index
                _attempt_now, applied = sessions.setdefault(rollout, (attempt, {}))
                if index in applied:
                    result.violations.append(
                        Violation(
                            "mutations_exactly_once",
                            f"{rollout} attempt {attempt}: tool call {index} ({record.tool}) applied "
                            f"twice in one session of {process.records[0].actor} ({process.inc})",
                            [applied[index], record],
                            rollout,
                        )
                    )
                applied[index] = record
    # (b) every sealed attempt's session verified with exactly the mutations its agent recorded.
    chain, _ = surviving_seals(controllers)
    verified: dict[tuple[str, int], SessionVerified] = {}
    for record in records:
        if record.role == Role.RESOURCES and isinstance(record, SessionVerified):
            verified[(record.rollout_id, record.attempt)] = record
    checked = 0
    for seal in chain:
        key = (seal.rollout_id, seal.attempt)
        session = verified.get(key)
        if session is None:
            result.violations.append(
                Violation(
                    "mutations_exactly_once",
                    f"{key[0]} attempt {key[1]} was sealed but its tool session never verified",
                    [seal],
                    key[0],
                )
            )
            continue
        checked += 1
        calls = list(session.applied)
        recorded, revision, reward = session.recorded, session.revision, session.reward
        if len(calls) != recorded or revision != recorded or reward != 1.0:
            what = "lost" if len(calls) < recorded or revision < recorded else "applied twice"
            result.violations.append(
                Violation(
                    "mutations_exactly_once",
                    f"{key[0]} attempt {key[1]}: its agent recorded {recorded} mutations, the session applied "
                    f"{len(calls)} (calls {calls}) at revision {revision}, reward {reward}: mutations {what}",
                    [session, seal],
                    key[0],
                )
            )
    result.detail = f"{mutations} mutations applied, {checked} sealed sessions verified"
    return result
