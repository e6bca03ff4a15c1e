"""``progress``: work was done, and in a chaos run, faults were injected and work followed each one."""

from __future__ import annotations

from parkway.actors.chaos.check.about import NEMESIS
from parkway.actors.chaos.check.run import RunHistory
from parkway.actors.chaos.check.verdict import CheckResult, Violation
from parkway.protocol.history import (
    FaultInjected,
    GenerationFinished,
    MutationApplied,
    RolloutSealed,
    RunFinished,
)

PROGRESS_KINDS = (RolloutSealed, GenerationFinished, MutationApplied, RunFinished)  # work done


def faults_injected(history: RunHistory) -> list[FaultInjected]:
    return [r for r in history.records if r.role == NEMESIS and isinstance(r, FaultInjected)]


def check_progress(history: RunHistory, chain: list[RolloutSealed]) -> CheckResult:
    records = history.records
    result = CheckResult("progress", "")
    generated = sum(1 for r in records if isinstance(r, GenerationFinished))
    mutations = sum(1 for r in records if isinstance(r, MutationApplied))
    faults = faults_injected(history)
    result.detail = f"{len(chain)} seals survive, {generated} model calls, {mutations} mutations"
    if not chain:
        result.violations.append(Violation("progress", "no rollout was sealed", records[-1:]))
    if not generated:
        result.violations.append(Violation("progress", "no model call was generated", records[-1:]))
    if history.chaos:
        result.detail += f", {len(faults)} faults"
        if not faults:
            result.violations.append(Violation("progress", "a chaos run injected no fault", records[-1:]))
        work_times = [r.t for r in records if isinstance(r, PROGRESS_KINDS) and r.role != NEMESIS]
        for fault in faults:
            if not any(t > fault.t for t in work_times):
                result.violations.append(
                    Violation(
                        "progress",
                        f"nothing was done after the fault {fault.fault} on {fault.target} at step {fault.step}",
                        [fault],
                    )
                )
    return result
