"""A check's verdict: the violations it found, and the shortest slice of history that shows each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parkway.actors.chaos.check.about import NEMESIS, mentions
from parkway.protocol.history import (
    FaultInjected,
    Record,
    RestoreFenced,
    RestoreStarted,
    RunFinished,
    RunStarted,
    Started,
)


@dataclass
class Violation:
    check: str
    message: str
    evidence: list[Record]  # the records that show it
    rollout: str | None = None  # whose records make the slice; None: the evidence alone

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "message": self.message,
            "rollout": self.rollout,
            "evidence": [r.to_json() for r in self.evidence],
        }


@dataclass
class CheckResult:
    name: str
    detail: str  # what was checked, in numbers
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass
class Verdict:
    checks: list[CheckResult]
    stats: dict[str, int]
    records: list[Record]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def violations(self) -> list[Violation]:
        return [v for c in self.checks for v in c.violations]

    def to_json(self, *, limit: int = 20) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "stats": self.stats,
            "checks": [
                {
                    "name": c.name,
                    "ok": c.ok,
                    "detail": c.detail,
                    "violations": [v.to_json() for v in c.violations[:limit]],
                    "violations_total": len(c.violations),
                }
                for c in self.checks
            ],
        }

    def report(self, *, max_violations: int = 3, max_lines: int = 40) -> str:
        """The verdict, one line per check; for each failed check, its first violations and the
        shortest slice of history that shows each."""
        t0 = self.records[0].t if self.records else 0.0
        lines = [f"history check: {'PASS' if self.ok else 'FAIL'} ({_stats_line(self.stats)})"]
        for check in self.checks:
            mark = "ok  " if check.ok else "FAIL"
            lines.append(f"  {mark} {check.name}: {check.detail}")
        for check in self.checks:
            for violation in check.violations[:max_violations]:
                lines.append("")
                lines.append(f"{check.name}: {violation.message}")
                lines.append("  the shortest history that shows it (> marks the evidence):")
                for record, marked in shortest_slice(self.records, violation, max_lines=max_lines):
                    lines.append(f"  {'>' if marked else ' '} {record.line(t0)}")
            if len(check.violations) > max_violations:
                lines.append(
                    f"  ... and {len(check.violations) - max_violations} more {check.name} violations"
                )
        return "\n".join(lines)


def _stats_line(stats: dict[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in stats.items())


# Kinds that say where the cluster was when something happened: kept in every slice.
_LANDMARKS = (Started, RestoreStarted, RestoreFenced, FaultInjected, RunStarted, RunFinished)


def shortest_slice(
    records: list[Record], violation: Violation, *, max_lines: int = 40
) -> list[tuple[Record, bool]]:
    """The violation's evidence, with the records of its rollout and the landmarks (process starts,
    restores, faults) before the last piece of evidence, in time order; long slices keep their ends."""
    evidence = {id(r) for r in violation.evidence}
    if not violation.evidence:
        return []
    last = max(r.t for r in violation.evidence)
    first_of_rollout = None
    chosen: list[tuple[Record, bool]] = []
    for record in records:
        if record.t > last:
            break
        marked = id(record) in evidence
        about = violation.rollout is not None and mentions(record, violation.rollout)
        if about and first_of_rollout is None:
            first_of_rollout = record.t
        landmark = isinstance(record, _LANDMARKS) and (
            record.role in ("controller", NEMESIS)
            or (isinstance(record, Started) and violation.rollout is not None)
        )
        if marked or about or landmark:
            chosen.append((record, marked))
    start = first_of_rollout if first_of_rollout is not None else min(r.t for r in violation.evidence)
    # Landmarks from before the rollout's first record say nothing about it: only the latest of each kind.
    kept: list[tuple[Record, bool]] = []
    seen_before: dict[tuple[str, str], tuple[Record, bool]] = {}
    for record, marked in chosen:
        if record.t < start and not marked:
            seen_before[(record.actor, record.kind)] = (record, marked)
        else:
            kept.append((record, marked))
    before = sorted(seen_before.values(), key=lambda item: item[0].t)
    result = before + kept
    if len(result) > max_lines:
        head = [item for item in result[: max_lines // 4]]
        tail = result[-(max_lines - len(head)) :]
        marked_middle = [item for item in result[len(head) : len(result) - len(tail)] if item[1]]
        result = head + marked_middle + tail
    return result
