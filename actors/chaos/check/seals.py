"""``run_completed`` and ``sealed_exactly_once``: the run ended with every expected rollout sealed once."""

from __future__ import annotations

from collections import defaultdict

from parkway.actors.chaos.check.timeline import (
    Incarnation,
    expected_rollouts,
    incarnations,
    surviving_seals,
)
from parkway.actors.chaos.check.verdict import CheckResult, Violation
from parkway.protocol.history import Dispatched, Record, RolloutSealed, RowSealed
from parkway.protocol.ids import Role


def check_run_completed(records: list[Record], controllers: list[Incarnation]) -> CheckResult:
    result = CheckResult("run_completed", "")
    if not controllers:
        result.violations.append(Violation("run_completed", "no controller recorded anything", []))
        result.detail = "no controller"
        return result
    last = controllers[-1]
    finished = last.finished
    if finished is None:
        tail = last.records[-1:]
        result.violations.append(
            Violation(
                "run_completed",
                f"the last controller ({last.inc}) never finished the run; its last record: "
                f"{tail[0].kind if tail else 'none'}",
                tail,
            )
        )
        result.detail = f"{len(controllers)} controller processes, none finished"
        return result
    sealed, failed, expected = finished.sealed, finished.failed, finished.expected
    result.detail = f"{sealed} of {expected} sealed, {failed} failed, {len(controllers)} controller processes"
    if sealed != expected or failed:
        result.violations.append(
            Violation(
                "run_completed",
                f"the run finished with {sealed} of {expected} rollouts sealed and {failed} failed",
                [finished],
            )
        )
    return result


def check_sealed_exactly_once(records: list[Record], controllers: list[Incarnation]) -> CheckResult:
    result = CheckResult("sealed_exactly_once", "")
    chain, trace = surviving_seals(controllers)
    expected = expected_rollouts(controllers)
    by_rollout: dict[str, list[RolloutSealed]] = defaultdict(list)
    for seal in chain:
        by_rollout[seal.rollout_id].append(seal)
    for rollout in expected:
        seals = by_rollout.get(rollout, [])
        if len(seals) > 1:
            attempts = ", ".join(f"attempt {s.attempt} (controller {s.inc})" for s in seals)
            result.violations.append(
                Violation(
                    "sealed_exactly_once",
                    f"{rollout} sealed {len(seals)} times: {attempts}",
                    list(seals),
                    rollout,
                )
            )
        elif not seals:
            evidence: list[Record] = [
                r for r in records if isinstance(r, Dispatched | RolloutSealed) and r.rollout_id == rollout
            ]
            result.violations.append(
                Violation(
                    "sealed_exactly_once",
                    f"{rollout} was never sealed in the timeline that survived ({'; '.join(trace)})",
                    evidence[-3:],
                    rollout,
                )
            )
    for rollout in sorted(set(by_rollout) - set(expected)):
        result.violations.append(
            Violation(
                "sealed_exactly_once",
                f"{rollout} was sealed but is not an expected rollout",
                list(by_rollout[rollout]),
                rollout,
            )
        )
    # TQ: a canonical row, once held, is never replaced by another attempt's.
    for tq in incarnations(records, Role.TQ):
        for record in tq.of(RowSealed):
            if record.replaced:
                result.violations.append(
                    Violation(
                        "sealed_exactly_once",
                        f"TQ ({tq.inc}) replaced the canonical row of {record.rollout_id} "
                        f"({record.replaced} -> {record.capture_key})",
                        [record],
                        record.rollout_id,
                    )
                )
    result.detail = (
        f"{len(expected)} expected, {len(chain)} seals survive ({'; '.join(trace) or 'no controller'})"
    )
    return result
