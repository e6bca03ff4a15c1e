"""``snapshots_verify``: every snapshot a controller published is on disk and verifies, and every
restore read a published one."""

from __future__ import annotations

from parkway.actors.chaos.check.run import RunHistory
from parkway.actors.chaos.check.timeline import Incarnation
from parkway.actors.chaos.check.verdict import CheckResult, Violation
from parkway.protocol.history import RestoreStarted, SnapshotPublished


def check_snapshots(history: RunHistory, controllers: list[Incarnation]) -> CheckResult:
    result = CheckResult("snapshots_verify", "")
    published = [r for inc in controllers for r in inc.of(SnapshotPublished)]
    cids = {r.checkpoint_id for r in published}
    for record in published:
        name = record.snapshot
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
        for restore in inc.of(RestoreStarted):
            if restore.saved_checkpoint_id not in cids:
                result.violations.append(
                    Violation(
                        "snapshots_verify",
                        f"controller {inc.inc} restored {restore.snapshot} "
                        f"({restore.saved_checkpoint_id}), which no controller published",
                        [restore],
                    )
                )
    unrecorded = sorted(set(history.snapshots) - {r.snapshot for r in published})
    bad_unrecorded = [name for name in unrecorded if history.snapshots[name]]
    for name in bad_unrecorded:
        result.violations.append(
            Violation(
                "snapshots_verify",
                f"snapshot {name} on disk does not verify: {history.snapshots[name][:3]}",
                [],
            )
        )
    restores = sum(len(inc.of(RestoreStarted)) for inc in controllers)
    result.detail = (
        f"{len(published)} published, {len(history.snapshots)} on disk checked, {restores} restores"
        + (f", {len(unrecorded)} on disk without a publish record" if unrecorded else "")
    )
    return result
