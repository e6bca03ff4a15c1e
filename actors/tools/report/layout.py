"""What the picture and the page share: which rollouts get a row and in what order, and the heading."""

from __future__ import annotations

from parkway.actors.tools.report.model import Rollout, Timeline
from parkway.protocol.ids import parse_rollout_id


def row_order(rollout: Rollout) -> tuple[str, int, str]:
    """By group, then by generation index as a number (``t0000_g2`` before ``t0000_g10``)."""
    try:
        index = parse_rollout_id(rollout.rollout_id)[1]
    except ValueError:  # a log line's id no builder made: drawn last in its group
        index = -1
    return (rollout.group_id, index, rollout.rollout_id)


def drawn_rows(timeline: Timeline, max_rows: int) -> tuple[list[Rollout], int]:
    """The rollouts drawn, by group; past ``max_rows``, the eventful ones first (a failed attempt, more
    attempts, never sealed)."""
    ordered = sorted(timeline.rollouts.values(), key=row_order)
    if len(ordered) <= max_rows:
        return ordered, 0

    def eventful(r: Rollout) -> tuple[bool, int, bool]:
        failed = any(a.outcome == "failed" for a in r.attempts.values())
        return (not failed, -len(r.attempts), r.sealed_attempt is not None)

    chosen = {r.rollout_id for r in sorted(ordered, key=eventful)[:max_rows]}
    return [r for r in ordered if r.rollout_id in chosen], len(ordered) - len(chosen)


def heading(timeline: Timeline) -> tuple[str, str]:
    """The title line (run, state, wall time) and the counts line under it."""
    s = timeline.summary()
    parts = [
        f"{s['rollouts']} rollouts in {s['groups']} groups",
        f"{s['attempts']} attempts",
        f"{s['turns_generated']} turns generated" + (f", {s['turns_kept']} kept" if s["turns_kept"] else ""),
        f"{s['snapshots']} snapshot{'s' if s['snapshots'] != 1 else ''} (pause p50 {s['pause_ms']['p50']:.0f} ms, max {s['pause_ms']['max']:.0f} ms)",
        f"{s['crashes']} crash{'es' if s['crashes'] != 1 else ''}",
        f"{s['restores']} restore{'s' if s['restores'] != 1 else ''}",
    ]
    state = "finished" if timeline.finished else "not finished in this log"
    return f"parkway run {timeline.run!r} ({state}, {s['wall_s']:.1f} s)", " · ".join(parts)
