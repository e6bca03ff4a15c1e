"""What a chaos run found: each workload's faults, verdict and summary, and the table over them all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parkway.actors.chaos.check import Verdict
from parkway.actors.chaos.schedule import Injected, render_table, table_rows


@dataclass
class WorkloadResult:
    index: int
    run: str
    plan: str
    faults: list[Injected] = field(default_factory=list)
    verdict: Verdict | None = None
    summary: dict[str, Any] | None = None
    error: str | None = None  # the workload did not finish, or the harness failed
    notes: list[str] = field(default_factory=list)  # unplanned exits and other things seen
    wall_s: float = 0.0
    controllers: int = 0

    @property
    def passed(self) -> bool:
        return (
            self.error is None
            and self.verdict is not None
            and self.verdict.ok
            and self.summary is not None
            and self.summary.get("rollouts_sealed") == self.summary.get("rollouts_expected")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "run": self.run,
            "plan": self.plan,
            "passed": self.passed,
            "error": self.error,
            "notes": self.notes,
            "wall_s": round(self.wall_s, 3),
            "controllers": self.controllers,
            "faults": [f.to_json() for f in self.faults],
            "verdict": self.verdict.to_json() if self.verdict is not None else None,
            "summary": self.summary,
        }


@dataclass
class ChaosResult:
    seed: int
    workloads: list[WorkloadResult]
    wall_s: float
    broker: str

    @property
    def faults(self) -> list[Injected]:
        return [f for w in self.workloads for f in w.faults]

    @property
    def passed(self) -> bool:
        return bool(self.workloads) and all(w.passed for w in self.workloads) and bool(self.faults)

    def rows(self) -> list[dict[str, Any]]:
        return table_rows(self.faults, {w.index: w.passed for w in self.workloads})

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "passed": self.passed,
            "wall_s": round(self.wall_s, 3),
            "broker": self.broker,
            "faults_injected": len(self.faults),
            "rollouts_sealed": sum((w.summary or {}).get("rollouts_sealed", 0) for w in self.workloads),
            "table": self.rows(),
            "workloads": [w.to_json() for w in self.workloads],
        }

    def text(self) -> str:
        lines = [render_table(self.rows()), ""]
        for w in self.workloads:
            sealed = (w.summary or {}).get("rollouts_sealed", "-")
            expected = (w.summary or {}).get("rollouts_expected", "-")
            state = "pass" if w.passed else "FAIL"
            lines.append(
                f"workload {w.index} ({w.run}): {state}, {len(w.faults)} faults, {w.controllers} controllers, "
                f"sealed {sealed}/{expected}, {w.wall_s:.1f}s; plan: {w.plan}"
            )
            for note in w.notes:
                lines.append(f"    note: {note}")
            if w.error:
                lines.append(f"    error: {w.error}")
            if w.verdict is not None and not w.verdict.ok:
                lines.extend("    " + line for line in w.verdict.report().splitlines())
        lines.append("")
        lines.append(
            f"chaos seed {self.seed}: {'PASS' if self.passed else 'FAIL'}: {len(self.workloads)} workloads, "
            f"{len(self.faults)} faults injected, {self.wall_s:.0f}s, broker {self.broker}"
        )
        return "\n".join(lines)
