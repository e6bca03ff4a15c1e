"""The history checker: a run's invariants, verified over what every actor recorded (``history.py``).

Pure: it takes the records (and what a snapshot check found on disk) and returns a ``Verdict``; the
caller reads the files. Each invariant is one named check; a failed one carries violations, each with a
precise message and the records that show it, and ``Verdict.report`` prints the shortest slice of the
history around each one: the offending rollout's records in time order, up to the evidence.

The checks (a run is correct when all pass):

- ``run_completed``: the last controller finished the run, every expected rollout sealed, none failed.
- ``sealed_exactly_once``: along the timeline that survived (the final controller, the snapshot it
  restored, the controller that published that snapshot up to its capture, and so on back), every
  expected rollout was sealed exactly once, and TQ never replaced a canonical row it held.
- ``no_turn_regenerated``: a rollout continued after a restore from ``k`` saved model calls never asks
  for (agent) or gets (policy) calls ``0..k-1`` again; only the call that was in flight is redone.
- ``mutations_exactly_once``: no tool mutation is applied twice in one session (whatever the
  redeliveries), and every sealed rollout's session verified with exactly the mutations its agent
  recorded: as many applied as recorded, revision equal, reward 1.0 (none lost, none doubled).
- ``fenced_attempts_stay_fenced``: once attempt N+1 of a rollout exists (dispatched, or created by a
  restore's fence), nothing of attempt N is accepted anywhere: no seal, no Run, no model call admitted
  or staged, no tool session opened or mutated, no TQ row.
- ``snapshots_verify``: every snapshot a controller published is on disk and verifies (manifest,
  digests, records, ledger, staging keys), and every restore read a published snapshot.
- ``progress``: work was done: rollouts sealed, model calls generated, tool mutations applied; in a
  chaos run, faults were injected and each one was followed by more work.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from parkway.actors.runtime.history import Record, RunHistory

CHECKS = (
    "run_completed",
    "sealed_exactly_once",
    "no_turn_regenerated",
    "mutations_exactly_once",
    "fenced_attempts_stay_fenced",
    "snapshots_verify",
    "progress",
)
NEMESIS = "nemesis"  # the actor name of the chaos harness's own records (faults injected)
_ATTEMPT_SUFFIX = re.compile(r"-a(\d+)$")
# Records that mean "a message of attempt (r, a) was accepted, acted on" (fenced_attempts_stay_fenced).
ACCEPTANCES = {
    ("controller", "seal"),
    ("agent", "run"),
    ("policy", "generate"),
    ("policy", "generated"),
    ("resources", "session_opened"),
    ("resources", "mutation"),
    ("resources", "verified"),
    ("tq", "staged"),
    ("tq", "sealed"),
}
PROGRESS_KINDS = frozenset({"seal", "generated", "mutation", "run_finished"})


def split_capture_key(ck: str) -> tuple[str, int]:
    """``t0000_g1-a2`` -> (``t0000_g1``, 2); ``t0000_g1`` -> (``t0000_g1``, 0)."""
    match = _ATTEMPT_SUFFIX.search(ck)
    if match is None:
        return ck, 0
    return ck[: match.start()], int(match[1])


def attempt_of(record: Record) -> tuple[str, int] | None:
    """The (rollout, attempt) a record is about, if it is about one."""
    if "r" in record.fields and "a" in record.fields:
        return str(record.fields["r"]), int(record.fields["a"])
    if "ck" in record.fields:
        return split_capture_key(str(record.fields["ck"]))
    return None


def mentions(record: Record, rollout: str) -> bool:
    """Whether a record is about ``rollout``: its own fields, or a list of attempts that names it."""
    about = attempt_of(record)
    if about is not None:
        return about[0] == rollout
    for key in ("attempts", "refs", "continued", "episodes"):
        for item in record.fields.get(key) or ():
            if isinstance(item, list | tuple) and item and item[0] == rollout:
                return True
    return any(rollout in (record.fields.get(key) or ()) for key in ("lost", "redo", "given_up"))


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
_LANDMARKS = frozenset({"started", "restore_started", "fenced", "fault", "run_started", "run_finished"})


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
        landmark = record.kind in _LANDMARKS and (
            record.role in ("controller", NEMESIS)
            or (record.kind == "started" and violation.rollout is not None)
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


# -- the timeline of controllers ----------------------------------------------------------------
@dataclass
class Incarnation:
    """One controller process: its records, and which snapshot (by checkpoint id) it restored."""

    inc: str  # the process (and incarnation within it) that recorded these
    records: list[Record]

    @property
    def restored_cid(self) -> str | None:
        for record in self.records:
            if record.kind == "restore_started":
                return str(record.fields["saved_cid"])
        return None

    @property
    def finished(self) -> Record | None:
        return next((r for r in self.records if r.kind == "run_finished"), None)

    def of(self, kind: str) -> list[Record]:
        return [r for r in self.records if r.kind == kind]


def incarnations(records: Iterable[Record], role: str = "controller") -> list[Incarnation]:
    by_inc: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        if record.role == role:
            by_inc[record.inc].append(record)
    found = [Incarnation(inc, sorted(rs, key=lambda r: r.n)) for inc, rs in by_inc.items()]
    return sorted(found, key=lambda inc: inc.records[0].t)


def surviving_seals(controllers: list[Incarnation]) -> tuple[list[Record], list[str]]:
    """The seal records of the timeline that survived, oldest first, and how it was traced.

    Start from the last controller: all its seals. If it restored a snapshot, the controller that
    published that snapshot contributes its seals up to the ledger's capture, and so on back until a
    controller that started afresh. Seals of controllers whose work no snapshot kept are not in it."""
    if not controllers:
        return [], []
    publisher = {}  # checkpoint id -> (incarnation, seals captured)
    for inc in controllers:
        captured = {str(r.fields["cid"]): int(r.fields["seals"]) for r in inc.of("captured")}
        for record in inc.of("published"):
            cid = str(record.fields["cid"])
            publisher[cid] = (inc, captured.get(cid, 0))
    final = next((inc for inc in reversed(controllers) if inc.finished is not None), controllers[-1])
    chain: list[Record] = []
    trace = []
    current: Incarnation | None = final
    limit: int | None = None
    visited: set[str] = set()
    while current is not None and current.inc not in visited:
        visited.add(current.inc)
        seals = [r for r in current.of("seal") if limit is None or int(r.fields["seq"]) <= limit]
        chain = seals + chain
        cid = current.restored_cid
        trace.append(f"controller {current.inc}: {len(seals)} seals" + (f", restored {cid}" if cid else ""))
        if cid is None or cid not in publisher:
            break
        current, limit = publisher[cid]
    return chain, trace


def expected_rollouts(controllers: list[Incarnation]) -> list[str]:
    for inc in reversed(controllers):
        for record in inc.of("run_started"):
            return list(record.fields.get("expected") or ())
    return []


# -- the checks -------------------------------------------------------------------------------------
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
    sealed, failed, expected = (int(finished.fields[k]) for k in ("sealed", "failed", "expected"))
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
    by_rollout: dict[str, list[Record]] = defaultdict(list)
    for seal in chain:
        by_rollout[str(seal.fields["r"])].append(seal)
    for rollout in expected:
        seals = by_rollout.get(rollout, [])
        if len(seals) > 1:
            attempts = ", ".join(f"attempt {s.fields['a']} (controller {s.inc})" for s in seals)
            result.violations.append(
                Violation(
                    "sealed_exactly_once", f"{rollout} sealed {len(seals)} times: {attempts}", seals, rollout
                )
            )
        elif not seals:
            evidence = [r for r in records if r.kind in ("dispatch", "seal") and r.fields.get("r") == rollout]
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
                by_rollout[rollout],
                rollout,
            )
        )
    # TQ: a canonical row, once held, is never replaced by another attempt's.
    for tq in incarnations(records, "tq"):
        for record in tq.of("sealed"):
            if record.fields.get("replaced"):
                result.violations.append(
                    Violation(
                        "sealed_exactly_once",
                        f"TQ ({tq.inc}) replaced the canonical row of {record.fields['r']} "
                        f"({record.fields['replaced']} -> {record.fields['ck']})",
                        [record],
                        str(record.fields["r"]),
                    )
                )
    result.detail = (
        f"{len(expected)} expected, {len(chain)} seals survive ({'; '.join(trace) or 'no controller'})"
    )
    return result


def check_no_turn_regenerated(records: list[Record]) -> CheckResult:
    result = CheckResult("no_turn_regenerated", "")
    continuations: dict[tuple[str, int], Record] = {}
    for record in records:
        if record.role == "agent" and record.kind == "continuation":
            continuations[(str(record.fields["r"]), int(record.fields["a"]))] = record
    calls = 0
    for record in records:
        if (record.role, record.kind) not in (("agent", "model_call"), ("policy", "generate")):
            continue
        key = (str(record.fields["r"]), int(record.fields["a"]))
        continuation = continuations.get(key)
        if continuation is None or record.t < continuation.t:
            continue
        calls += 1
        kept = int(continuation.fields["kept_model"])
        if int(record.fields["i"]) < kept:
            who = "asked for" if record.role == "agent" else "generated"
            result.violations.append(
                Violation(
                    "no_turn_regenerated",
                    f"{key[0]} attempt {key[1]} continued from {kept} saved model calls, yet "
                    f"{record.actor} {who} call {record.fields['i']} again",
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
    for process in incarnations(records, "resources"):
        sessions: dict[str, tuple[int, dict[int, Record]]] = {}
        for record in process.records:
            if record.kind == "session_opened":
                sessions[str(record.fields["r"])] = (int(record.fields["a"]), {})
            elif record.kind == "session_restored":
                applied = {int(i): record for i in record.fields.get("applied") or ()}
                sessions[str(record.fields["r"])] = (int(record.fields["a"]), applied)
            elif record.kind == "mutation":
                mutations += 1
                rollout, attempt, index = (
                    str(record.fields["r"]),
                    int(record.fields["a"]),
                    int(record.fields["i"]),
                )
                _attempt_now, applied = sessions.setdefault(rollout, (attempt, {}))
                if index in applied:
                    result.violations.append(
                        Violation(
                            "mutations_exactly_once",
                            f"{rollout} attempt {attempt}: tool call {index} ({record.fields.get('tool')}) applied "
                            f"twice in one session of {process.records[0].actor} ({process.inc})",
                            [applied[index], record],
                            rollout,
                        )
                    )
                applied[index] = record
    # (b) every sealed attempt's session verified with exactly the mutations its agent recorded.
    chain, _ = surviving_seals(controllers)
    verified: dict[tuple[str, int], Record] = {}
    for record in records:
        if record.role == "resources" and record.kind == "verified":
            verified[(str(record.fields["r"]), int(record.fields["a"]))] = record
    checked = 0
    for seal in chain:
        key = (str(seal.fields["r"]), int(seal.fields["a"]))
        record = verified.get(key)
        if record is None:
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
        applied = list(record.fields.get("applied") or ())
        recorded, revision, reward = (
            int(record.fields["recorded"]),
            int(record.fields["rev"]),
            float(record.fields["reward"]),
        )
        if len(applied) != recorded or revision != recorded or reward != 1.0:
            what = "lost" if len(applied) < recorded or revision < recorded else "applied twice"
            result.violations.append(
                Violation(
                    "mutations_exactly_once",
                    f"{key[0]} attempt {key[1]}: its agent recorded {recorded} mutations, the session applied "
                    f"{len(applied)} (calls {applied}) at revision {revision}, reward {reward}: mutations {what}",
                    [record, seal],
                    key[0],
                )
            )
    result.detail = f"{mutations} mutations applied, {checked} sealed sessions verified"
    return result


def check_fenced_attempts(records: list[Record]) -> CheckResult:
    """One sweep in time order over the timeline that is live: a dispatch of attempt N+1 (or a restore's
    fence of N) supersedes N; an acceptance of a superseded attempt is a violation. A restore rolls the
    timeline back to its snapshot: what the dead controller dispatched after that snapshot's capture
    no longer exists (the restored ledger gives those numbers out again). Between a controller's death
    and the next restore's fence nothing is judged: the restore stops and fences what ran meanwhile."""
    result = CheckResult("fenced_attempts_stay_fenced", "")
    captured_at = {
        str(r.fields["cid"]): r.t for r in records if r.role == "controller" and r.kind == "captured"
    }
    superseded: dict[tuple[str, int], Record] = {}  # (rollout, attempt) -> the record that superseded it
    controller: str | None = None  # the incarnation whose timeline is live; None between two
    accepted = fenced = 0

    def supersede(rollout: str, attempt: int, record: Record) -> None:
        for older in range(attempt):
            superseded.setdefault((rollout, older), record)

    for record in records:
        if record.role == "controller":
            if record.kind == "started":
                controller = None  # a new controller: the old timeline is over, the new one not yet set
            elif record.kind == "fenced":
                cut = captured_at.get(str(record.fields["saved_cid"]), record.t)
                superseded = {k: v for k, v in superseded.items() if v.t <= cut}
                for rollout, attempt in record.fields.get("attempts") or ():
                    supersede(str(rollout), int(attempt) + 1, record)
                controller, fenced = record.inc, fenced + 1
            elif record.kind == "run_started" and not record.fields.get("restored"):
                superseded, controller = {}, record.inc  # a fresh ledger
            elif record.kind == "dispatch" and record.inc == controller:
                supersede(str(record.fields["r"]), int(record.fields["a"]), record)
            if record.kind != "seal" or record.inc != controller:
                continue  # of the controller's records only its seals accept something
        if (record.role, record.kind) not in ACCEPTANCES or controller is None:
            continue
        if record.kind == "run" and record.fields.get("outcome") != "accepted":
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


def check_snapshots(history: RunHistory, controllers: list[Incarnation]) -> CheckResult:
    result = CheckResult("snapshots_verify", "")
    published = [r for inc in controllers for r in inc.of("published")]
    cids = {str(r.fields["cid"]) for r in published}
    for record in published:
        name = str(record.fields["snapshot"])
        problems = history.snapshots.get(name)
        if problems is None:
            result.violations.append(
                Violation("snapshots_verify", f"published snapshot {name} is not on disk", [record])
            )
        elif problems:
            result.violations.append(
                Violation(
                    "snapshots_verify",
                    f"published snapshot {name} does not verify: {'; '.join(problems[:5])}",
                    [record],
                )
            )
    for inc in controllers:
        for record in inc.of("restore_started"):
            if str(record.fields["saved_cid"]) not in cids:
                result.violations.append(
                    Violation(
                        "snapshots_verify",
                        f"controller {inc.inc} restored {record.fields['snapshot']} "
                        f"({record.fields['saved_cid']}), which no controller published",
                        [record],
                    )
                )
    unrecorded = sorted(set(history.snapshots) - {str(r.fields["snapshot"]) for r in published})
    bad_unrecorded = [name for name in unrecorded if history.snapshots[name]]
    for name in bad_unrecorded:
        result.violations.append(
            Violation(
                "snapshots_verify",
                f"snapshot {name} on disk does not verify: {history.snapshots[name][:3]}",
                [],
            )
        )
    restores = sum(len(inc.of("restore_started")) for inc in controllers)
    result.detail = (
        f"{len(published)} published, {len(history.snapshots)} on disk checked, {restores} restores"
        + (f", {len(unrecorded)} on disk without a publish record" if unrecorded else "")
    )
    return result


def check_progress(history: RunHistory, chain: list[Record]) -> CheckResult:
    records = history.records
    result = CheckResult("progress", "")
    generated = sum(1 for r in records if r.kind == "generated")
    mutations = sum(1 for r in records if r.kind == "mutation")
    faults = [r for r in records if r.role == NEMESIS and r.kind == "fault"]
    result.detail = f"{len(chain)} seals survive, {generated} model calls, {mutations} mutations"
    if not chain:
        result.violations.append(Violation("progress", "no rollout was sealed", records[-1:]))
    if not generated:
        result.violations.append(Violation("progress", "no model call was generated", records[-1:]))
    if history.chaos:
        result.detail += f", {len(faults)} faults"
        if not faults:
            result.violations.append(Violation("progress", "a chaos run injected no fault", records[-1:]))
        work_times = [r.t for r in records if r.kind in PROGRESS_KINDS and r.role != NEMESIS]
        for fault in faults:
            if not any(t > fault.t for t in work_times):
                result.violations.append(
                    Violation(
                        "progress",
                        f"nothing was done after the fault {fault.fields.get('fault')} on "
                        f"{fault.fields.get('target')} at step {fault.fields.get('step')}",
                        [fault],
                    )
                )
    return result


def check(history: RunHistory) -> Verdict:
    """Every check over one run's history."""
    records = sorted(history.records, key=lambda r: (r.t, r.actor, r.inc, r.n))
    history = RunHistory(records, history.snapshots, history.chaos)
    controllers = incarnations(records)
    chain, _ = surviving_seals(controllers)
    runners: list[Callable[[], CheckResult]] = [
        lambda: check_run_completed(records, controllers),
        lambda: check_sealed_exactly_once(records, controllers),
        lambda: check_no_turn_regenerated(records),
        lambda: check_mutations_exactly_once(records, controllers),
        lambda: check_fenced_attempts(records),
        lambda: check_snapshots(history, controllers),
        lambda: check_progress(history, chain),
    ]
    checks = [run() for run in runners]
    stats = {
        "records": len(records),
        "processes": len({(r.actor, r.inc) for r in records}),
        "controllers": len(controllers),
        "seals": len(chain),
        "restores": sum(len(inc.of("fenced")) for inc in controllers),
        "faults": sum(1 for r in records if r.role == NEMESIS and r.kind == "fault"),
    }
    return Verdict(checks, stats, records)
