"""Building a run's ``Timeline`` from its records, one record at a time.

Each event the actors log has a handler (``on_<event>``); a warning or an error without one is kept as a
notable event for the HTML page. A process that starts again, or whose lines end, closes what it had
open at its last line: that is how a crash shows without anyone logging it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from parkway.actors.tools.report.model import (
    CONTROLLER,
    Attempt,
    Crash,
    Event,
    Pause,
    ProcessStart,
    Restore,
    Rollout,
    Timeline,
    TrainPoint,
    Turn,
)
from parkway.actors.tools.report.records import last_session, parse_lines
from parkway.protocol.ids import parse_rollout_id

MAX_EVENTS = 500  # notable events listed in the HTML page


def _detail(record: dict[str, Any]) -> str:
    skip = {"ts", "_t", "event", "actor", "role", "replica", "run", "level"}
    return " ".join(f"{k}={record[k]}" for k in sorted(record) if k not in skip)


class TimelineBuilder:
    """The timeline being built, with what is still open: pauses and restores by checkpoint id, each
    actor's last line, whether the controller's current incarnation has ended."""

    def __init__(self, run: str) -> None:
        self.timeline = Timeline(run=run)
        self.last_ts: dict[str, float] = {}
        self.started: set[str] = set()
        self.pauses: dict[str, Pause] = {}
        self.restores: dict[str, Restore] = {}
        self.incarnation_open = False  # a controller incarnation without run_finished or run_aborted
        self.incarnation_aborted = False
        self.training: dict[int, TrainPoint] = {}

    # helpers
    def rollout(self, rollout_id: str, group_id: str | None = None) -> Rollout:
        rollout = self.timeline.rollouts.get(rollout_id)
        if rollout is None:
            group = group_id or _group_of(rollout_id)
            rollout = self.timeline.rollouts[rollout_id] = Rollout(rollout_id, group)
        elif group_id:
            rollout.group_id = group_id
        return rollout

    def attempt(self, record: dict[str, Any]) -> Attempt | None:
        rollout_id, index = record.get("rollout_id"), record.get("attempt")
        if not isinstance(rollout_id, str) or not isinstance(index, int):
            return None
        rollout = self.rollout(rollout_id, record.get("group_id"))
        if index not in rollout.attempts:
            rollout.attempts[index] = Attempt(rollout_id, index)
        return rollout.attempts[index]

    def close_attempt(self, attempt: Attempt, ts: float, outcome: str) -> None:
        turn = attempt.open_turn()
        if turn is not None:  # no turn_finished: the attempt ended (stopped, failed, died) inside it
            turn.end, turn.cut = max(ts, turn.start), True
        if attempt.ended is None:
            attempt.ended = max(ts, attempt.started or attempt.dispatched or ts)
            attempt.outcome = outcome

    def process_gone(self, actor: str, ts: float) -> None:
        """A process of ``actor`` ended (it starts again, or the log ends): what it had open ends at ``ts``."""
        for attempt in self.timeline.attempts():
            if attempt.ended is not None:
                continue
            owner = attempt.agent if attempt.started is not None else CONTROLLER
            if owner == actor:
                self.close_attempt(attempt, ts, "cut")
        if actor == CONTROLLER:
            for pause in self.pauses.values():
                if pause.end is None:
                    pause.end, pause.outcome = max(ts, pause.start), "cut"
            for restore in self.restores.values():
                if restore.end is None:
                    restore.end, restore.outcome = max(ts, restore.start), "cut"

    def note(self, record: dict[str, Any], actor: str) -> None:
        if len(self.timeline.events) < MAX_EVENTS:
            self.timeline.events.append(
                Event(record["_t"], actor, str(record.get("level", "")), record["event"], _detail(record))
            )

    # one record
    def feed(self, record: dict[str, Any]) -> None:
        ts, event = record["_t"], record["event"]
        actor = str(record.get("actor", "-"))
        handler = getattr(self, f"on_{event}", None)
        if handler is not None:
            handler(record, ts, actor)
        elif record.get("level") in ("warning", "error", "critical"):
            self.note(record, actor)
        self.last_ts[actor] = ts

    def on_actor_started(self, record: dict[str, Any], ts: float, actor: str) -> None:
        restart = actor in self.started
        if restart:
            self.process_gone(actor, self.last_ts.get(actor, ts))
        self.started.add(actor)
        pid = record.get("pid")
        self.timeline.processes.append(
            ProcessStart(actor, ts, pid if isinstance(pid, int) else None, restart)
        )
        if actor != CONTROLLER:
            return
        if self.incarnation_open and not self.incarnation_aborted:
            last = self.last_ts.get(CONTROLLER, ts)
            self.timeline.crashes.append(
                Crash(last, f"{CONTROLLER} started again without finishing the run (its last line)", True)
            )
        self.timeline.incarnations += 1
        self.incarnation_open, self.incarnation_aborted = True, False
        self.timeline.finished = False

    def on_run_started(self, record: dict[str, Any], ts: float, actor: str) -> None:
        if not self.incarnation_open:  # a log that lacks the controller's actor_started
            self.timeline.incarnations += 1
            self.incarnation_open, self.incarnation_aborted = True, False
        self.note(record, actor)

    def on_run_finished(self, record: dict[str, Any], ts: float, actor: str) -> None:
        self.incarnation_open = False
        self.timeline.finished = True
        self.note(record, actor)

    def on_run_aborted(self, record: dict[str, Any], ts: float, actor: str) -> None:
        self.incarnation_aborted = True
        self.timeline.crashes.append(Crash(ts, str(record.get("error", "")), False))
        for pause in self.pauses.values():
            if pause.end is None:
                pause.end, pause.outcome = ts, "cut"
        self.note(record, actor)

    def on_rollout_dispatched(self, record: dict[str, Any], ts: float, actor: str) -> None:
        attempt = self.attempt(record)
        if attempt is None:
            return
        attempt.dispatched = ts
        replica = record.get("replica")
        attempt.replica = replica if isinstance(replica, int) else None
        continue_from = record.get("continue_from")
        attempt.continue_from = continue_from if isinstance(continue_from, int) else None

    def on_rollout_started(self, record: dict[str, Any], ts: float, actor: str) -> None:
        attempt = self.attempt(record)
        if attempt is None:
            return
        if attempt.ended is not None:  # started again (after a restore): what it did before is superseded
            attempt.superseded.extend(attempt.turns)
            attempt.turns, attempt.ended, attempt.outcome = [], None, "running"
        attempt.started, attempt.agent = ts, actor
        kept = record.get("kept_turns")
        attempt.kept_turns = kept if isinstance(kept, int) else 0
        attempt.continuing = bool(record.get("continuing"))
        if attempt.replica is None and isinstance(record.get("replica"), int):
            attempt.replica = record["replica"]

    def on_turn_started(self, record: dict[str, Any], ts: float, actor: str) -> None:
        attempt = self.attempt(record)
        index = record.get("turn")
        if attempt is None or not isinstance(index, int):
            return
        if attempt.started is None:
            attempt.started, attempt.agent = ts, actor
        previous = attempt.open_turn()
        if previous is not None:
            previous.end = ts
        attempt.turns.append(Turn(index, ts, replayed=bool(record.get("replayed"))))

    def on_turn_finished(self, record: dict[str, Any], ts: float, actor: str) -> None:
        attempt = self.attempt(record)
        turn = attempt.open_turn() if attempt is not None else None
        if turn is not None and turn.index == record.get("turn"):
            turn.end = ts

    def _attempt_end(self, record: dict[str, Any], ts: float, outcome: str) -> None:
        attempt = self.attempt(record)
        if attempt is not None:
            self.close_attempt(attempt, ts, outcome)
            if outcome == "failed":
                attempt.code = str(record.get("code", ""))

    def on_rollout_completed(self, record: dict[str, Any], ts: float, actor: str) -> None:
        self._attempt_end(record, ts, "completed")

    def on_rollout_failed(self, record: dict[str, Any], ts: float, actor: str) -> None:
        self._attempt_end(record, ts, "failed")

    def on_rollout_stopped(self, record: dict[str, Any], ts: float, actor: str) -> None:
        self._attempt_end(record, ts, "stopped")

    def on_sealed(self, record: dict[str, Any], ts: float, actor: str) -> None:
        attempt = self.attempt(record)
        if attempt is None:
            return
        attempt.sealed = True
        rollout = self.timeline.rollouts[attempt.rollout_id]
        rollout.sealed_attempt = attempt.index
        turns = record.get("turns")
        rollout.sealed_turns = turns if isinstance(turns, int) else None

    def on_attempt_failed(self, record: dict[str, Any], ts: float, actor: str) -> None:
        attempt = self.attempt(record)
        if attempt is not None and not attempt.code:
            attempt.code = str(record.get("code", ""))
        self.note(record, actor)

    def on_gate_closed(self, record: dict[str, Any], ts: float, actor: str) -> None:
        cid = str(record.get("checkpoint_id", f"?{len(self.timeline.pauses)}"))
        pause = Pause(cid, ts)
        self.pauses[cid] = pause
        self.timeline.pauses.append(pause)

    def on_gate_opened(self, record: dict[str, Any], ts: float, actor: str) -> None:
        pause = self.pauses.get(str(record.get("checkpoint_id")))
        if pause is None or pause.end is not None:
            return
        pause.end = ts
        ms = record.get("paused_ms")
        pause.ms = float(ms) if isinstance(ms, int | float) else (ts - pause.start) * 1000
        if pause.outcome == "open":
            pause.outcome = "reopened"

    def on_snapshot_published(self, record: dict[str, Any], ts: float, actor: str) -> None:
        pause = self.pauses.get(str(record.get("checkpoint_id")))
        if pause is not None:
            pause.snapshot, pause.outcome = str(record.get("snapshot", "")), "published"

    def on_snapshot_aborted(self, record: dict[str, Any], ts: float, actor: str) -> None:
        pause = self.pauses.get(str(record.get("checkpoint_id")))
        if pause is not None:
            pause.outcome = "aborted"
        self.note(record, actor)

    def on_restore_started(self, record: dict[str, Any], ts: float, actor: str) -> None:
        cid = str(record.get("checkpoint_id", f"?restore{len(self.timeline.restores)}"))
        restore = Restore(
            cid,
            ts,
            snapshot=str(record.get("snapshot", "")),
            saved_checkpoint=str(record.get("saved_checkpoint", "")),
        )
        self.restores[cid] = restore
        self.timeline.restores.append(restore)
        saved = self.pauses.get(restore.saved_checkpoint)
        if saved is not None:  # published just before a crash: the restore names it
            saved.snapshot, saved.outcome = restore.snapshot, "published"
        self.note(record, actor)

    def on_restore_done(self, record: dict[str, Any], ts: float, actor: str) -> None:
        restore = self.restores.get(str(record.get("checkpoint_id")))
        if restore is not None:
            restore.end, restore.outcome = ts, "done"
            continued = record.get("continued")
            restore.continued = continued if isinstance(continued, int) else None
        self.note(record, actor)

    def on_restore_failed(self, record: dict[str, Any], ts: float, actor: str) -> None:
        restore = self.restores.get(str(record.get("checkpoint_id")))
        if restore is not None:
            restore.end, restore.outcome = ts, "failed"
        self.note(record, actor)

    def on_restore_from_fallback_marker(self, record: dict[str, Any], ts: float, actor: str) -> None:
        restore = Restore(f"fallback-{len(self.timeline.restores)}", ts, ts, outcome="fallback")
        restore.snapshot = f"trainer step {record.get('trainer_step')} (fallback marker)"
        self.timeline.restores.append(restore)
        self.note(record, actor)

    def on_trained(self, record: dict[str, Any], ts: float, actor: str) -> None:
        self._train_point(record, ts)

    def on_grpo_step(self, record: dict[str, Any], ts: float, actor: str) -> None:
        self._train_point(record, ts)

    def _train_point(self, record: dict[str, Any], ts: float) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        point = self.training.setdefault(step, TrainPoint(step, ts))
        point.ts = ts
        for name in ("mean_reward", "loss"):
            value = record.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                setattr(point, name, float(value))

    def on_agent_replica_restarted(self, record: dict[str, Any], ts: float, actor: str) -> None:
        event = Event(ts, actor, str(record.get("level", "")), record["event"], _detail(record))
        self.timeline.replica_restarts.append(event)
        self.note(record, actor)

    def finish(self, records: list[dict[str, Any]]) -> Timeline:
        timeline = self.timeline
        controller = [r["_t"] for r in records if r.get("actor") == CONTROLLER]
        timeline.start = controller[0] if controller else (records[0]["_t"] if records else 0.0)
        timeline.end = records[-1]["_t"] if records else timeline.start
        for actor, last in sorted(self.last_ts.items()):
            self.process_gone(actor, last)
        for attempt in timeline.attempts():  # owned by an actor whose lines never came (lost, or filtered)
            if attempt.ended is None:
                self.close_attempt(attempt, timeline.end, "cut")
        for pause in timeline.pauses:
            if pause.end is None:
                pause.end, pause.outcome = timeline.end, "cut"
            if pause.ms is None:
                pause.ms = (pause.end - pause.start) * 1000
        for restore in timeline.restores:
            if restore.end is None:
                restore.end, restore.outcome = timeline.end, "cut"
        timeline.training = [self.training[step] for step in sorted(self.training)]
        return timeline


def build_timeline(lines: Iterable[bytes | str], run: str) -> Timeline:
    """The timeline of ``run`` from raw log lines (any order, any mix of actors and sources)."""
    records, counts = parse_lines(lines, run)
    records, earlier = last_session(records)
    builder = TimelineBuilder(run)
    for record in records:
        builder.feed(record)
    timeline = builder.finish(records)
    counts.earlier_sessions = earlier
    counts.used = len(records)
    timeline.lines = counts
    return timeline


def _group_of(rollout_id: str) -> str:
    """The group a rollout id names; an id no builder made stands for its own group."""
    try:
        return parse_rollout_id(rollout_id)[0]
    except ValueError:
        return rollout_id
