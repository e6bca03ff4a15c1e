"""The model of a run's picture: rollouts with their attempts and turns, snapshot pauses, restores,
crashes and process starts, each an interval or a moment in epoch seconds.

Built by ``builder.build_timeline`` from log lines; drawn by ``figure`` and ``page``.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

CONTROLLER = "controller/0"


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
    # Turns of an earlier life of this same attempt, ended by a crash: a restore that found the attempt
    # dispatched but holding no turn of it starts it again under its number, from its first turn.
    superseded: list[Turn] = field(default_factory=list)

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
class TrainPoint:
    """One train step: the controller's ``trained`` line (mean reward) and a trainer's loss (the
    ``trained`` line's ``loss`` or the GRPO trainer's ``grpo_step``). A step trained again after a
    crash keeps its newest values."""

    step: int
    ts: float
    mean_reward: float | None = None
    loss: float | None = None


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
    training: list[TrainPoint] = field(default_factory=list)  # by step
    incarnations: int = 0
    finished: bool = False
    lines: LineCounts = field(default_factory=LineCounts)

    def attempts(self) -> list[Attempt]:
        return [a for r in self.rollouts.values() for a in r.attempts.values()]

    def summary(self) -> dict[str, Any]:
        attempts = self.attempts()
        turns = [t for a in attempts for t in (*a.superseded, *a.turns)]
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
            "train_steps": len(self.training),
            "incarnations": self.incarnations,
            "process_restarts": sum(1 for p in self.processes if p.restart),
            "agent_replica_restarts": len(self.replica_restarts),
            "lines": dataclasses.asdict(self.lines),
        }
