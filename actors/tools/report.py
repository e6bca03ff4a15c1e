"""``parkway report RUN``: a picture of a run, drawn from the actors' structured log lines.

The lines come from saved log files (``parkway run ... 2> run.log``, each actor's stderr) and/or the
run's log stream on the broker. ``build_timeline`` turns them into a typed ``Timeline``: rollouts with
their attempts and turns as intervals, the snapshot pauses (the controller's admission gate closed) with
their checkpoint ids, crashes, restores and process starts. ``render_png`` and ``render_html`` draw it;
matplotlib is imported only there (``pip install 'parkway[report]'``).

What the lines may hold, and what happens to it:

- a line that is not a JSON object with ``ts`` and ``event`` is skipped and counted (``malformed``);
- a line of another run, or of no run, is dropped and counted; the same line seen twice (a file and the
  broker both hold it) counts once;
- the same run started afresh after it completed (a new *session*): only the newest session is drawn;
- a crash: an interval a process left open ends at that process's last line when it starts again; the
  controller starting again without ``run_finished`` is a crash at its last line (``run_aborted`` gives
  the exact moment and the reason); whatever is still open at the end ends at its owner's last line and
  is flagged ``cut``.

The events read (all ``info`` unless noted): ``actor_started``; the controller's ``run_started``
(``restored``), ``run_finished``, ``run_aborted`` (error), ``rollout_dispatched``, ``sealed``,
``attempt_failed`` (warning), ``gate_closed``/``gate_opened`` and ``snapshot_published``/
``snapshot_aborted`` (by checkpoint id), ``restore_started``/``restore_done``/``restore_failed``,
``agent_replica_restarted`` (warning); the agents' ``rollout_started``, ``turn_started``/
``turn_finished`` (turn index, ``replayed``), ``rollout_completed``/``rollout_failed``/
``rollout_stopped``. Other warnings and errors are listed in the HTML page.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import html
import io
import json
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

CONTROLLER = "controller/0"
# Attempt colours: blues and oranges first; red and green are kept for the crash and the restore.
ATTEMPT_COLORS = ("#4C72B0", "#DD8452", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")
PAUSE_COLOR = "#7f7f7f"
CRASH_COLOR = "#d62728"
RESTORE_COLOR = "#2ca02c"
REPLICA_RESTART_COLOR = "#ff7f0e"
MAX_EVENTS = 500  # notable events listed in the HTML page
INSTALL_HINT = "pip install 'parkway[report]'"


class ReportError(Exception):
    """Nothing to draw, or nothing to draw with; the message says which."""


# -- the timeline ----------------------------------------------------------------------------------


@dataclass
class Turn:
    index: int
    start: float
    end: float | None = None
    replayed: bool = False  # a turn kept from a snapshot: replayed from the transcript, not generated
    cut: bool = False  # never finished: ended by a crash or by the end of the log


@dataclass
class Attempt:
    rollout_id: str
    index: int
    replica: int | None = None
    agent: str | None = None  # the actor that ran it
    dispatched: float | None = None
    started: float | None = None
    ended: float | None = None
    outcome: str = "running"  # completed | failed | stopped | cut | running
    code: str = ""
    continuing: bool = False  # continues a transcript restored from a snapshot
    kept_turns: int = 0  # its turns kept from the snapshot (replayed, not generated again)
    continue_from: int | None = None
    sealed: bool = False
    turns: list[Turn] = field(default_factory=list)

    def open_turn(self) -> Turn | None:
        return self.turns[-1] if self.turns and self.turns[-1].end is None else None


@dataclass
class Rollout:
    rollout_id: str
    group_id: str
    attempts: dict[int, Attempt] = field(default_factory=dict)
    sealed_attempt: int | None = None
    sealed_turns: int | None = None  # what the agent's receipt said

    @property
    def final(self) -> Attempt | None:
        if self.sealed_attempt is not None and self.sealed_attempt in self.attempts:
            return self.attempts[self.sealed_attempt]
        return self.attempts[max(self.attempts)] if self.attempts else None

    @property
    def turns(self) -> int:
        """Turns of the attempt that counts (the sealed one, else the newest), kept turns included."""
        final = self.final
        return len(final.turns) if final is not None else 0


@dataclass
class Pause:
    """The admission gate closed for one snapshot: rollouts park at their next boundary."""

    checkpoint_id: str
    start: float
    end: float | None = None
    ms: float | None = None
    snapshot: str = ""
    outcome: str = "open"  # published | aborted | cut | reopened (gate open again, not known published)


@dataclass
class Restore:
    checkpoint_id: str
    start: float
    end: float | None = None
    snapshot: str = ""
    saved_checkpoint: str = ""
    continued: int | None = None
    outcome: str = "running"  # done | failed | fallback | cut


@dataclass
class Crash:
    ts: float
    detail: str
    inferred: bool  # from the controller starting again, not from its own run_aborted line


@dataclass
class ProcessStart:
    actor: str
    ts: float
    pid: int | None
    restart: bool


@dataclass
class Event:
    ts: float
    actor: str
    level: str
    event: str
    detail: str


@dataclass
class LineCounts:
    read: int = 0
    used: int = 0
    malformed: int = 0
    other_runs: int = 0
    no_run: int = 0
    duplicates: int = 0
    earlier_sessions: int = 0


@dataclass
class Timeline:
    run: str
    start: float = 0.0  # the session's first controller line (else its first line)
    end: float = 0.0
    rollouts: dict[str, Rollout] = field(default_factory=dict)
    pauses: list[Pause] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)
    crashes: list[Crash] = field(default_factory=list)
    processes: list[ProcessStart] = field(default_factory=list)
    replica_restarts: list[Event] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    incarnations: int = 0
    finished: bool = False
    lines: LineCounts = field(default_factory=LineCounts)

    def attempts(self) -> list[Attempt]:
        return [a for r in self.rollouts.values() for a in r.attempts.values()]

    def summary(self) -> dict[str, Any]:
        attempts = self.attempts()
        turns = [t for a in attempts for t in a.turns]
        pauses = [p.ms for p in self.pauses if p.ms is not None and p.outcome != "cut"]  # the gate reopened
        return {
            "run": self.run,
            "finished": self.finished,
            "wall_s": round(self.end - self.start, 3),
            "rollouts": len(self.rollouts),
            "rollouts_sealed": sum(1 for r in self.rollouts.values() if r.sealed_attempt is not None),
            "groups": len({r.group_id for r in self.rollouts.values()}),
            "attempts": len(attempts),
            "turns": len(turns),
            "turns_generated": sum(1 for t in turns if not t.replayed),
            "turns_kept": sum(1 for t in turns if t.replayed),
            "turns_cut": sum(1 for t in turns if t.cut),
            "snapshots": sum(1 for p in self.pauses if p.outcome == "published"),
            "pauses": len(self.pauses),
            "pause_ms": {
                "p50": round(statistics.median(pauses), 3) if pauses else 0.0,
                "max": round(max(pauses), 3) if pauses else 0.0,
            },
            "crashes": len(self.crashes),
            "restores": sum(1 for r in self.restores if r.outcome in ("done", "fallback")),
            "incarnations": self.incarnations,
            "process_restarts": sum(1 for p in self.processes if p.restart),
            "agent_replica_restarts": len(self.replica_restarts),
            "lines": dataclasses.asdict(self.lines),
        }


# -- reading lines ---------------------------------------------------------------------------------

_decoder = msgspec.json.Decoder()


def _timestamp(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)  # structlog writes UTC
    return moment.timestamp()


def parse_lines(lines: Iterable[bytes | str], run: str) -> tuple[list[dict[str, Any]], LineCounts]:
    """The records of ``run`` in time order, with a ``_t`` (epoch seconds) each, and what was skipped."""
    counts = LineCounts()
    seen: set[bytes] = set()
    records: list[dict[str, Any]] = []
    for raw in lines:
        data = (raw.encode() if isinstance(raw, str) else raw).strip()
        if not data:
            continue
        counts.read += 1
        try:
            record = _decoder.decode(data)
        except msgspec.DecodeError:
            counts.malformed += 1
            continue
        ts = _timestamp(record.get("ts")) if isinstance(record, dict) else None
        if ts is None or not isinstance(record.get("event"), str):
            counts.malformed += 1
            continue
        if "run" not in record:
            counts.no_run += 1
            continue
        if record["run"] != run:
            counts.other_runs += 1
            continue
        if data in seen:
            counts.duplicates += 1
            continue
        seen.add(data)
        record["_t"] = ts
        records.append(record)
    records.sort(key=lambda r: r["_t"])  # stable: one process's lines keep their order on a tie
    counts.used = len(records)
    return records, counts


def read_files(paths: Sequence[str]) -> list[bytes]:
    lines: list[bytes] = []
    for path in paths:
        if path == "-":
            lines += sys.stdin.buffer.read().splitlines()
        else:
            lines += Path(path).read_bytes().splitlines()
    return lines


async def read_broker(url: str, run: str, *, idle: float) -> list[bytes]:
    """Every line of the run's log stream, from the start, until ``idle`` seconds pass without one."""
    from parkway.brokers import connect

    lines: list[bytes] = []
    async with connect(url, run) as broker:
        stream = broker.follow_logs(from_start=True)
        try:
            while True:
                try:
                    lines.append(await asyncio.wait_for(anext(stream), idle))
                except TimeoutError:
                    break
        finally:
            await stream.aclose()
    return lines


def _last_session(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The records from the newest session on: a run started again after it finished is a new one,
    from the first process start after the old one's ``run_finished`` (its stopping lines stay behind)."""
    cut, finished = 0, False
    for index, record in enumerate(records):
        if record["event"] == "run_finished" and record.get("actor") == CONTROLLER:
            finished = True
        elif finished and record["event"] in ("actor_started", "run_started"):
            cut, finished = index, False
    return records[cut:], cut


# -- building the timeline -------------------------------------------------------------------------


def _detail(record: dict[str, Any]) -> str:
    skip = {"ts", "_t", "event", "actor", "role", "replica", "run", "level"}
    return " ".join(f"{k}={record[k]}" for k in sorted(record) if k not in skip)


class _Builder:
    def __init__(self, run: str) -> None:
        self.t = Timeline(run=run)
        self.last_ts: dict[str, float] = {}
        self.started: set[str] = set()
        self.pauses: dict[str, Pause] = {}
        self.restores: dict[str, Restore] = {}
        self.incarnation_open = False  # a controller incarnation without run_finished or run_aborted
        self.incarnation_aborted = False

    # helpers
    def rollout(self, rollout_id: str, group_id: str | None = None) -> Rollout:
        rollout = self.t.rollouts.get(rollout_id)
        if rollout is None:
            group = group_id or rollout_id.rpartition("_g")[0] or rollout_id
            rollout = self.t.rollouts[rollout_id] = Rollout(rollout_id, group)
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
        for attempt in self.t.attempts():
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
        if len(self.t.events) < MAX_EVENTS:
            self.t.events.append(
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
        self.t.processes.append(ProcessStart(actor, ts, pid if isinstance(pid, int) else None, restart))
        if actor != CONTROLLER:
            return
        if self.incarnation_open and not self.incarnation_aborted:
            last = self.last_ts.get(CONTROLLER, ts)
            self.t.crashes.append(
                Crash(last, f"{CONTROLLER} started again without finishing the run (its last line)", True)
            )
        self.t.incarnations += 1
        self.incarnation_open, self.incarnation_aborted = True, False
        self.t.finished = False

    def on_run_started(self, record: dict[str, Any], ts: float, actor: str) -> None:
        if not self.incarnation_open:  # a log that lacks the controller's actor_started
            self.t.incarnations += 1
            self.incarnation_open, self.incarnation_aborted = True, False
        self.note(record, actor)

    def on_run_finished(self, record: dict[str, Any], ts: float, actor: str) -> None:
        self.incarnation_open = False
        self.t.finished = True
        self.note(record, actor)

    def on_run_aborted(self, record: dict[str, Any], ts: float, actor: str) -> None:
        self.incarnation_aborted = True
        self.t.crashes.append(Crash(ts, str(record.get("error", "")), False))
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
        rollout = self.t.rollouts[attempt.rollout_id]
        rollout.sealed_attempt = attempt.index
        turns = record.get("turns")
        rollout.sealed_turns = turns if isinstance(turns, int) else None

    def on_attempt_failed(self, record: dict[str, Any], ts: float, actor: str) -> None:
        attempt = self.attempt(record)
        if attempt is not None and not attempt.code:
            attempt.code = str(record.get("code", ""))
        self.note(record, actor)

    def on_gate_closed(self, record: dict[str, Any], ts: float, actor: str) -> None:
        cid = str(record.get("checkpoint_id", f"?{len(self.t.pauses)}"))
        pause = Pause(cid, ts)
        self.pauses[cid] = pause
        self.t.pauses.append(pause)

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
        cid = str(record.get("checkpoint_id", f"?restore{len(self.t.restores)}"))
        restore = Restore(
            cid,
            ts,
            snapshot=str(record.get("snapshot", "")),
            saved_checkpoint=str(record.get("saved_checkpoint", "")),
        )
        self.restores[cid] = restore
        self.t.restores.append(restore)
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
        restore = Restore(f"fallback-{len(self.t.restores)}", ts, ts, outcome="fallback")
        restore.snapshot = f"trainer step {record.get('trainer_step')} (fallback marker)"
        self.t.restores.append(restore)
        self.note(record, actor)

    def on_agent_replica_restarted(self, record: dict[str, Any], ts: float, actor: str) -> None:
        event = Event(ts, actor, str(record.get("level", "")), record["event"], _detail(record))
        self.t.replica_restarts.append(event)
        self.note(record, actor)

    def finish(self, records: list[dict[str, Any]]) -> Timeline:
        t = self.t
        controller = [r["_t"] for r in records if r.get("actor") == CONTROLLER]
        t.start = controller[0] if controller else (records[0]["_t"] if records else 0.0)
        t.end = records[-1]["_t"] if records else t.start
        for actor, last in sorted(self.last_ts.items()):
            self.process_gone(actor, last)
        for attempt in t.attempts():  # owned by an actor whose lines never came (lost, or filtered)
            if attempt.ended is None:
                self.close_attempt(attempt, t.end, "cut")
        for pause in t.pauses:
            if pause.end is None:
                pause.end, pause.outcome = t.end, "cut"
            if pause.ms is None:
                pause.ms = (pause.end - pause.start) * 1000
        for restore in t.restores:
            if restore.end is None:
                restore.end, restore.outcome = t.end, "cut"
        return t


def build_timeline(lines: Iterable[bytes | str], run: str) -> Timeline:
    """The timeline of ``run`` from raw log lines (any order, any mix of actors and sources)."""
    records, counts = parse_lines(lines, run)
    records, earlier = _last_session(records)
    builder = _Builder(run)
    for record in records:
        builder.feed(record)
    timeline = builder.finish(records)
    counts.earlier_sessions = earlier
    counts.used = len(records)
    timeline.lines = counts
    return timeline


# -- drawing ---------------------------------------------------------------------------------------


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ReportError(f"drawing the report needs matplotlib: {INSTALL_HINT} ({exc})") from None
    return matplotlib, Figure


def _row_order(rollout: Rollout) -> tuple[str, int, str]:
    """By group, then by generation index as a number (``t0000_g2`` before ``t0000_g10``)."""
    index = rollout.rollout_id.rpartition("_g")[2]
    return (rollout.group_id, int(index) if index.isdigit() else -1, rollout.rollout_id)


def _rows(timeline: Timeline, max_rows: int) -> tuple[list[Rollout], int]:
    """The rollouts drawn, by group; past ``max_rows``, the eventful ones first (a failed attempt, more
    attempts, never sealed)."""
    ordered = sorted(timeline.rollouts.values(), key=_row_order)
    if len(ordered) <= max_rows:
        return ordered, 0

    def eventful(r: Rollout) -> tuple[bool, int, bool]:
        failed = any(a.outcome == "failed" for a in r.attempts.values())
        return (not failed, -len(r.attempts), r.sealed_attempt is not None)

    chosen = {r.rollout_id for r in sorted(ordered, key=eventful)[:max_rows]}
    return [r for r in ordered if r.rollout_id in chosen], len(ordered) - len(chosen)


def _title(timeline: Timeline) -> tuple[str, str]:
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


@dataclass
class Drawing:
    """The figure and what each drawn piece means (hover titles in the HTML)."""

    figure: Any
    titles: dict[str, str]
    hidden_rows: int


def draw(timeline: Timeline, *, max_rows: int = 150) -> Drawing:
    """The figure: one row per rollout (by group), turns as bars, pauses as bands, crash and restore lines."""
    _, Figure = _matplotlib()
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    rows, hidden = _rows(timeline, max_rows)
    t0 = timeline.start
    span = max(timeline.end - t0, 1e-3)
    min_width = span / 1500  # about a pixel: a 20 ms pause in an hour-long run still shows
    height = min(3.4 + 0.24 * max(len(rows), 1), 60.0)
    figure = Figure(figsize=(14, height), dpi=100, layout="constrained")
    ax = figure.add_subplot()
    titles: dict[str, str] = {}

    def tag(artist: Any, text: str) -> None:
        gid = f"pk{len(titles)}"
        artist.set_gid(gid)
        titles[gid] = text

    def top_label(x: float, text: str, color: str, *, right: bool) -> None:
        ax.annotate(
            text,
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-2 if right else 2, 2),
            textcoords="offset points",
            ha="right" if right else "left",
            va="bottom",
            color=color,
            fontsize=8,
            fontweight="bold",
            annotation_clip=False,
        )

    # Prompt groups: alternate stripes behind their rows.
    y_of = {r.rollout_id: i for i, r in enumerate(rows)}
    groups: dict[str, list[int]] = {}
    for r in rows:
        groups.setdefault(r.group_id, []).append(y_of[r.rollout_id])
    for n, ys in enumerate(groups.values()):
        if n % 2:
            ax.axhspan(min(ys) - 0.5, max(ys) + 0.5, color="#f0f0f0", zorder=0, lw=0)
    # Snapshot pauses, restores, crashes, agent replicas that came back.
    for pause in timeline.pauses:
        end = pause.end if pause.end is not None else pause.start
        band = ax.axvspan(
            pause.start - t0,
            pause.start - t0 + max(end - pause.start, min_width),
            color=PAUSE_COLOR,
            alpha=0.35,
            lw=0,
            zorder=3.5,  # over the bars: a turn held by the pause shows it
        )
        where = f" -> {pause.snapshot}" if pause.snapshot else f" ({pause.outcome})"
        tag(band, f"snapshot pause {pause.checkpoint_id}: {pause.ms or 0:.1f} ms{where}")
    for restore in timeline.restores:
        end = restore.end if restore.end is not None else restore.start
        if end > restore.start:
            band = ax.axvspan(restore.start - t0, end - t0, color=RESTORE_COLOR, alpha=0.15, lw=0, zorder=1)
            tag(band, f"restoring {restore.snapshot} ({restore.checkpoint_id})")
        if restore.outcome in ("done", "fallback"):
            line = ax.axvline(end - t0, color=RESTORE_COLOR, lw=2, zorder=4)
            tag(
                line,
                f"restored {restore.snapshot} ({restore.checkpoint_id}), {restore.continued} rollouts continued",
            )
            top_label(end - t0, f"restore {restore.snapshot}", RESTORE_COLOR, right=False)
    for crash in timeline.crashes:
        line = ax.axvline(crash.ts - t0, color=CRASH_COLOR, lw=2, zorder=4)
        tag(line, f"crash: {crash.detail}")
        top_label(crash.ts - t0, "crash", CRASH_COLOR, right=True)
    for event in timeline.replica_restarts:
        line = ax.axvline(event.ts - t0, color=REPLICA_RESTART_COLOR, lw=1.5, ls="--", zorder=4)
        tag(line, f"agent replica restarted: {event.detail}")
    # Rollouts: a thin line for each attempt's life, a bar per turn, a mark for how it ended.
    lives: list[list[tuple[float, float]]] = []
    life_colors: list[str] = []
    marks: dict[str, tuple[list[float], list[float]]] = {"sealed": ([], []), "failed": ([], [])}
    drawn_attempts: set[int] = set()
    any_cut = any_kept = False
    for rollout in rows:
        y = y_of[rollout.rollout_id]
        for attempt in rollout.attempts.values():
            color = ATTEMPT_COLORS[attempt.index % len(ATTEMPT_COLORS)]
            begin = attempt.started if attempt.started is not None else attempt.dispatched
            if begin is not None and attempt.ended is not None:
                lives.append([(begin - t0, y), (attempt.ended - t0, y)])
                life_colors.append(color)
            for turn in attempt.turns:
                if turn.replayed or turn.end is None:
                    continue  # a kept turn took no time: the marker at the attempt's start says how many
                any_cut |= turn.cut
                drawn_attempts.add(attempt.index)
                bar = Rectangle(
                    (turn.start - t0, y - 0.31),
                    max(turn.end - turn.start, min_width),
                    0.62,
                    facecolor=color,
                    edgecolor="white",
                    linewidth=0.4,
                    hatch="////" if turn.cut else None,
                    alpha=0.5 if turn.cut else 1.0,
                    zorder=3,
                )
                ax.add_patch(bar)
                tag(
                    bar,
                    f"{rollout.rollout_id} attempt {attempt.index} turn {turn.index}: "
                    f"{turn.start - t0:.3f}-{turn.end - t0:.3f} s ({(turn.end - turn.start) * 1000:.1f} ms)"
                    + (", never finished" if turn.cut else ""),
                )
            if attempt.continuing and attempt.started is not None:
                any_kept = True
                ax.plot(
                    attempt.started - t0, y, marker=">", color=color, ms=6, mec="black", mew=0.5, zorder=5
                )
            if attempt.kept_turns and attempt.started is not None:
                ax.annotate(
                    f"{attempt.kept_turns} kept",
                    (attempt.started - t0, y),
                    xytext=(4, 4),
                    textcoords="offset points",
                    fontsize=6.5,
                    color="#333333",
                    zorder=6,
                )
            kind = "sealed" if attempt.sealed else "failed" if attempt.outcome == "failed" else None
            if kind is not None and attempt.ended is not None:
                marks[kind][0].append(attempt.ended - t0)
                marks[kind][1].append(y)
    ax.add_collection(LineCollection(lives, colors=life_colors, linewidths=1, zorder=2))
    ax.plot(*marks["sealed"], ls="", marker="o", color="black", ms=3.5, zorder=5)
    ax.plot(*marks["failed"], ls="", marker="x", color="black", ms=5, mew=1.2, zorder=5)
    # Axes, title, legend.
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [r.rollout_id for r in rows], fontsize=8 if len(rows) <= 60 else 5.5)
    ax.set_xlim(0, span * 1.01)
    started = datetime.fromtimestamp(t0, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    ax.set_xlabel(f"seconds since the controller's first line ({started})")
    ax.set_ylabel("rollout (grouped by prompt group)")
    ax.grid(axis="x", color="#dddddd", lw=0.6)
    ax.set_axisbelow(True)
    heading, counts = _title(timeline)
    figure.suptitle(f"{heading}\n{counts}", fontsize=11, x=0.01, ha="left")
    handles: list[Any] = [
        Patch(color=ATTEMPT_COLORS[i % len(ATTEMPT_COLORS)], label=f"turn, attempt {i}")
        for i in sorted(drawn_attempts)
    ]
    if any_cut:
        handles.append(
            Patch(
                facecolor="#999999", alpha=0.5, hatch="////", edgecolor="white", label="turn never finished"
            )
        )
    if any_kept:
        handles.append(
            Line2D(
                [],
                [],
                marker=">",
                color="#999999",
                mec="black",
                mew=0.5,
                ls="",
                label="continued from a snapshot",
            )
        )
    if marks["sealed"][0]:
        handles.append(Line2D([], [], marker="o", color="black", ms=3.5, ls="", label="sealed"))
    if marks["failed"][0]:
        handles.append(Line2D([], [], marker="x", color="black", ms=5, ls="", label="attempt failed"))
    if timeline.pauses:
        handles.append(Patch(color=PAUSE_COLOR, alpha=0.35, label="snapshot pause\n(admission closed)"))
    if timeline.crashes:
        handles.append(Line2D([], [], color=CRASH_COLOR, lw=2, label="crash"))
    if timeline.restores:
        handles.append(Line2D([], [], color=RESTORE_COLOR, lw=2, label="restore done"))
    if timeline.replica_restarts:
        handles.append(
            Line2D([], [], color=REPLICA_RESTART_COLOR, lw=1.5, ls="--", label="agent replica restarted")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    if hidden:
        ax.set_title(
            f"{hidden} of {len(timeline.rollouts)} rollouts not drawn (--max-rows {max_rows}); "
            "those with a failed attempt, more attempts, or not sealed are drawn first",
            fontsize=8,
            color="#aa0000",
            loc="left",
        )
    return Drawing(figure, titles, hidden)


def render_png(drawing: Drawing, path: Path) -> Path:
    drawing.figure.savefig(path, format="png", dpi=100)
    return path


def _svg(drawing: Drawing) -> str:
    matplotlib, _ = _matplotlib()
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "parkway"}):
        drawing.figure.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg") :]  # inline: no XML declaration, no DOCTYPE
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)

    def titled(match: re.Match[str]) -> str:
        text = drawing.titles.get(match.group(1))
        return match.group(0) + (f"<title>{html.escape(text)}</title>" if text else "")

    return re.sub(r'<g id="(pk\d+)">', titled, svg)


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(timeline: Timeline, drawing: Drawing, path: Path) -> Path:
    """One self-contained file: the picture as inline SVG (hover a bar for its times), then tables."""
    t0 = timeline.start
    heading, counts = _title(timeline)
    summary = timeline.summary()
    snapshots = _table(
        ["#", "checkpoint id", "snapshot", "at (s)", "pause (ms)", "outcome"],
        (
            (n, p.checkpoint_id, p.snapshot or "-", f"{p.start - t0:.3f}", _ms(p.ms), p.outcome)
            for n, p in enumerate(timeline.pauses, 1)
        ),
    )
    restores = _table(
        ["restore id", "snapshot", "saved checkpoint id", "at (s)", "took (ms)", "continued", "outcome"],
        (
            (
                r.checkpoint_id,
                r.snapshot,
                r.saved_checkpoint or "-",
                f"{r.start - t0:.3f}",
                _ms(((r.end or r.start) - r.start) * 1000),
                "-" if r.continued is None else r.continued,
                r.outcome,
            )
            for r in timeline.restores
        ),
    )
    crashes = _table(
        ["at (s)", "what", "how known"],
        (
            (
                f"{c.ts - t0:.3f}",
                c.detail,
                "inferred: the controller started again" if c.inferred else "run_aborted",
            )
            for c in timeline.crashes
        ),
    )
    processes = _table(
        ["at (s)", "actor", "pid", "restart"],
        ((f"{p.ts - t0:.3f}", p.actor, p.pid or "-", "yes" if p.restart else "") for p in timeline.processes),
    )
    rollouts = _table(
        ["rollout", "group", "attempts", "turns", "kept", "sealed attempt", "outcomes"],
        (
            (
                r.rollout_id,
                r.group_id,
                len(r.attempts),
                r.turns,
                sum(a.kept_turns for a in r.attempts.values()),
                "-" if r.sealed_attempt is None else r.sealed_attempt,
                ", ".join(
                    f"{a.index}:{a.outcome}{'/' + a.code if a.code else ''}" for a in r.attempts.values()
                ),
            )
            for r in sorted(timeline.rollouts.values(), key=_row_order)
        ),
    )
    events = _table(
        ["at (s)", "actor", "level", "event", "detail"],
        ((f"{e.ts - t0:.3f}", e.actor, e.level, e.event, e.detail) for e in timeline.events),
    )
    lines = _table(["lines", "count"], summary["lines"].items())
    totals = _table(
        ["what", "value"],
        (
            (k, json.dumps(v) if isinstance(v, dict) else v)
            for k, v in summary.items()
            if k not in ("lines", "run")
        ),
    )
    hidden = (
        f"<p class=warn>{drawing.hidden_rows} of {len(timeline.rollouts)} rollouts are not drawn; "
        "the rollout table below lists every one.</p>"
        if drawing.hidden_rows
        else ""
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>parkway report: {html.escape(timeline.run)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.4em; margin-bottom: 0.2em; }} h2 {{ font-size: 1.1em; margin-top: 1.6em; }}
.counts {{ color: #555; margin-top: 0; }} .warn {{ color: #a00; }}
.figure svg {{ width: 100%; height: auto; }} img {{ max-width: 100%; }}
table {{ border-collapse: collapse; font-size: 12px; }}
th, td {{ border: 1px solid #ddd; padding: 2px 6px; text-align: left; font-family: ui-monospace, monospace; }}
th {{ background: #f4f4f4; }}
</style></head><body>
<h1>{html.escape(heading)}</h1>
<p class="counts">{html.escape(counts)}</p>
<p>One row per rollout, grouped by prompt group; bars are turns (from the model call to the next
boundary), coloured by attempt; grey bands are snapshot pauses (the controller's admission gate
closed); a red line is a crash, a green one the end of a restore. Hover a bar or a band for its times.</p>
{hidden}
<div class="figure">{_svg(drawing)}</div>
<h2>Snapshots ({len(timeline.pauses)} pauses)</h2>{snapshots}
<h2>Restores</h2>{restores}
<h2>Crashes</h2>{crashes}
<h2>Summary</h2>{totals}
<details><summary>Rollouts ({len(timeline.rollouts)})</summary>{rollouts}</details>
<details><summary>Process starts ({len(timeline.processes)})</summary>{processes}</details>
<details><summary>Notable events ({len(timeline.events)})</summary>{events}</details>
<details><summary>Log lines read</summary>{lines}</details>
</body></html>
"""
    path.write_text(page, encoding="utf-8")
    return path


def write_report(timeline: Timeline, out: Path, *, max_rows: int = 150) -> tuple[Path, Path]:
    """``out/RUN.png`` and ``out/RUN.html``."""
    out.mkdir(parents=True, exist_ok=True)
    drawing = draw(timeline, max_rows=max_rows)
    png = render_png(drawing, out / f"{timeline.run}.png")
    page = render_html(timeline, drawing, out / f"{timeline.run}.html")
    return png, page


# -- the command -----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="the run's name")
    parser.add_argument(
        "--logs",
        nargs="+",
        action="extend",
        default=[],
        metavar="FILE",
        help="saved JSON log lines (parkway run --log-level info 2> FILE, each actor's stderr; - for stdin)",
    )
    parser.add_argument(
        "--broker",
        help="read the run's log stream on this broker (default: $PARKWAY_BROKER_URL without --logs)",
    )
    parser.add_argument("--out", default=".", help="directory for RUN.png and RUN.html (default: .)")
    parser.add_argument("--json", action="store_true", help="print a summary object instead of the paths")
    parser.add_argument("--max-rows", type=int, default=150, help="rollouts drawn at most (default 150)")
    parser.add_argument(
        "--idle",
        type=float,
        default=2.0,
        help="reading the broker: stop after this many seconds with no new line",
    )


def command(args: argparse.Namespace) -> int:
    import os

    from parkway.actors.runtime.settings import SettingsError
    from parkway.brokers.urls import redact_url
    from parkway.protocol.ids import validate_name

    try:
        validate_name(args.run, "run")
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    url = args.broker or (None if args.logs else os.environ.get("PARKWAY_BROKER_URL"))
    if not args.logs and not url:
        print(
            "parkway: report: give --logs FILE ... or --broker URL (or set PARKWAY_BROKER_URL)",
            file=sys.stderr,
        )
        return 2
    if url and url.startswith("memory://"):
        print(
            "parkway: report: a memory:// broker's log stream lives only in its own process", file=sys.stderr
        )
        return 2
    try:
        lines = read_files(args.logs)
    except OSError as exc:
        print(f"parkway: report: {exc}", file=sys.stderr)
        return 2
    if url:
        lines += asyncio.run(read_broker(url, args.run, idle=args.idle))
    timeline = build_timeline(lines, args.run)
    sources = ", ".join([*args.logs, *([redact_url(url)] if url else [])])
    if not timeline.lines.used:
        counts = timeline.lines
        print(
            f"parkway: report: no log line of run {args.run!r} in {sources} ({counts.read} read, "
            f"{counts.other_runs} of other runs, {counts.no_run} without a run, {counts.malformed} malformed)",
            file=sys.stderr,
        )
        return 1
    if not timeline.incarnations:
        print(
            f"parkway: report: no run_started line of {CONTROLLER}: dispatches, snapshot pauses and seals "
            "are missing (run the workload with parkway run --log-level info)",
            file=sys.stderr,
        )
    try:
        png, page = write_report(timeline, Path(args.out), max_rows=args.max_rows)
    except ReportError as exc:
        print(f"parkway: report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**timeline.summary(), "png": str(png), "html": str(page)}, sort_keys=True))
    else:
        print(png)
        print(page)
    return 0
