"""The nemesis's plan, pure: which faults a chaos run injects, where, in which workload; and the table.

A chaos run is a sequence of workloads; each workload gets a ``WorkloadPlan`` drawn from one seed:

- ``controller_points``: fault points (``faults.py``) armed on successive controller processes: the
  first controller dies at the first point, the one started after it at the second, and so on. A
  ``kill_cluster`` fault is a controller point at which the harness also kills every other process;
- ``actor_points``: a fault point armed on one participant process (it SIGKILLs itself there);
- ``outage_points``: fault points armed on the controller with ``=STOP``: the controller stops itself
  at that exact step of a save (``save_*``, ``after_*``) or a restore (``restore_*``), the harness takes
  the broker down (or makes the state directory unwritable) for ``down_s`` with the controller running
  again, then brings it back;
- ``timed``: faults the harness injects itself, at a time into the workload or when the controller
  starts a snapshot step: SIGKILL of one actor, SIGSTOP/SIGCONT of one process or all, a broker
  restart or a broker crash.

Every fault actually injected becomes a row of the table: fault kind by protocol step (the exact point
for armed faults; for the others the step the controller's history shows at that moment), with how
many times it ran and whether every workload that contained it passed the history checker.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from parkway.protocol.history import (
    Record,
    RestoreStarted,
    RunFinished,
    RunStarted,
    SnapshotAborted,
    SnapshotDone,
    SnapshotFailed,
    SnapshotSkipped,
    SnapshotStep,
)
from parkway.protocol.snapshot import RESTORE_SEQUENCE, SAVE_SEQUENCE


class FaultKind(StrEnum):
    KILL_ACTOR = "kill_actor"  # SIGKILL one participant process, then start it again
    KILL_CONTROLLER = "kill_controller"  # SIGKILL the controller (parkway run); a new one restores
    KILL_CLUSTER = (
        "kill_cluster"  # SIGKILL every process at once, then start them all; the controller restores
    )
    PAUSE_ACTOR = "pause_actor"  # SIGSTOP one process (the controller included), then SIGCONT
    PAUSE_CLUSTER = "pause_cluster"  # SIGSTOP every process, then SIGCONT
    BROKER_RESTART = "broker_restart"  # rabbitmqctl stop_app / start_app on the run's own node
    BROKER_KILL = "broker_kill"  # SIGKILL the broker node's VM, then start it on the same data
    STATE_UNWRITABLE = "state_unwritable"  # the run's snapshot directory replaced by a file, then back
    # On a broker cluster (``broker_nodes`` > 1): one node's broker stopped, then started again; the
    # last node (the controller connects to the first, some actors to this one), or the first.
    NODE_STOP = "node_stop"
    NODE_STOP_CONTROLLERS = "node_stop_controllers"


BROKER_KINDS = frozenset({FaultKind.BROKER_RESTART, FaultKind.BROKER_KILL})
NODE_KINDS = frozenset({FaultKind.NODE_STOP, FaultKind.NODE_STOP_CONTROLLERS})
OUTAGE_KINDS = BROKER_KINDS | NODE_KINDS | {FaultKind.STATE_UNWRITABLE}
BROKER_OUTAGE_S = 3.0  # how long the broker stays down in a matrix's outage at a point
SAVE_STEPS: tuple[str, ...] = tuple(step.name.value for step in SAVE_SEQUENCE)
RESTORE_POINTS = (
    "after_restore_agent",
    "after_restore_policy",
    "after_restore_resources",
    "after_restore_tq",
)
# Every controller fault point of a save: at the start of a step (save_*) and at its end (after_*).
SAVE_POINTS: tuple[str, ...] = tuple(p for s in SAVE_STEPS for p in (f"save_{s}", f"after_{s}"))
# The controller's fault point at the start of each step of a restore.
RESTORE_STEP_POINTS: tuple[str, ...] = tuple(f"restore_{step.name.value}" for step in RESTORE_SEQUENCE)
OUTAGES_PER_WORKLOAD = {"save": 8, "restore": 5}  # a restore's own deadline bounds how many it takes
PARTICIPANTS = ("tq/0", "policy/0", "resources/0", "resources/1", "agent/0", "agent/1")
# Participant fault points: the process kills itself at this step of a snapshot or a restore.
ACTOR_POINTS: tuple[str, ...] = (
    "participant_prepare",  # in the middle of a Prepare (before it parked)
    "after_reply_journaled:Prepare",  # prepared and journaled, the reply not sent
    "after_reply_sent:Commit",  # committed (its cut taken in memory), reply sent
    "after_reply_sent:Persist",  # its cut written, reply sent (after the window)
    "after_reply_sent:Resume",  # resumed
)
BETWEEN = "between snapshots"


@dataclass(frozen=True)
class ActorPoint:
    address: str  # which participant
    point: str  # a fault point, e.g. "after_reply_sent:Commit"
    nth: int = 1  # the N-th time it reaches the point

    @property
    def spec(self) -> str:
        """The ``PARKWAY_FAULTS`` value that arms it."""
        if self.point == "participant_prepare":
            return f"participant_prepare:{self.address.split('/')[0]}@{self.nth}"
        return f"{self.point}@{self.nth}"


@dataclass(frozen=True)
class ControllerPoint:
    point: str  # e.g. "after_commit"
    nth: int = 1
    cluster: bool = False  # kill_cluster: every other process dies at the same moment

    @property
    def spec(self) -> str:
        return f"{self.point}@{self.nth}"

    @property
    def kind(self) -> FaultKind:
        return FaultKind.KILL_CLUSTER if self.cluster else FaultKind.KILL_CONTROLLER


@dataclass(frozen=True)
class OutagePoint:
    """An outage at an exact step: the controller stops itself at ``point`` (its ``nth`` hit), the
    harness breaks the broker or the state directory, continues the controller, and repairs it all
    ``down_s`` later."""

    point: str  # a save point (save_*, after_*) or a restore step point (restore_*)
    kind: FaultKind  # one of OUTAGE_KINDS
    down_s: float = BROKER_OUTAGE_S
    nth: int = 1

    @property
    def spec(self) -> str:
        return f"{self.point}=STOP@{self.nth}"

    @property
    def in_restore(self) -> bool:
        """Armed only on a controller that restores (one started after another died)."""
        return self.point in RESTORE_STEP_POINTS

    @property
    def target(self) -> str:
        return "state" if self.kind is FaultKind.STATE_UNWRITABLE else "broker"


@dataclass(frozen=True)
class TimedFault:
    kind: FaultKind
    target: str  # an address, "controller", "cluster" or "broker"
    at_s: float  # seconds into the workload (or after ``at_step`` is seen)
    at_step: str | None = None  # fire when the controller starts this save step
    hold_s: float = 0.0  # pauses: how long the process stays stopped


@dataclass
class WorkloadPlan:
    index: int
    seed: int
    controller_points: list[ControllerPoint] = field(default_factory=list)
    actor_points: list[ActorPoint] = field(default_factory=list)
    timed: list[TimedFault] = field(default_factory=list)
    outage_points: list[OutagePoint] = field(default_factory=list)

    def describe(self) -> str:
        parts = [f"{p.kind.value}@{p.spec}" for p in self.controller_points]
        parts += [f"kill_actor {p.address}@{p.spec}" for p in self.actor_points]
        parts += [f"{p.kind.value} {p.down_s:.0f}s at {p.point}@{p.nth}" for p in self.outage_points]
        parts += [
            f"{t.kind.value} {t.target} at {t.at_step or f'{t.at_s:.1f}s'}"
            + (f" for {t.hold_s:.1f}s" if t.hold_s else "")
            for t in self.timed
        ]
        return "; ".join(parts) or "no faults"


@dataclass(frozen=True)
class Cell:
    """One thing the matrix covers: a fault kind at a protocol step (a point, or a step to wait for)."""

    kind: FaultKind
    step: str  # a controller point, an actor point, a save step (timed, at_step) or BETWEEN
    target: str | None = None  # kill_actor: which participant (None: one drawn from the seed)

    @property
    def outage_at_point(self) -> bool:
        """An outage at an exact save or restore step (an ``OutagePoint``), not a timed one."""
        return self.kind in OUTAGE_KINDS and self.step in (*SAVE_POINTS, *RESTORE_STEP_POINTS)


def broker_restarts_at_every_step() -> list[Cell]:
    """A broker restart (down ``BROKER_OUTAGE_S``) at the start and the end of every save step and at
    the start of every restore step."""
    return [Cell(FaultKind.BROKER_RESTART, p) for p in (*SAVE_POINTS, *RESTORE_STEP_POINTS)]


def node_stops(points: Sequence[str] = SAVE_POINTS) -> list[Cell]:
    """A broker cluster's node stopped at each of ``points``: another's node, and the controller's."""
    return [Cell(kind, p) for p in points for kind in (FaultKind.NODE_STOP, FaultKind.NODE_STOP_CONTROLLERS)]


def matrix(*, broker: bool, nodes: bool = False) -> list[Cell]:
    """Every (fault kind, step) a full chaos matrix covers (``nodes``: on a broker cluster)."""
    cells = [Cell(FaultKind.KILL_CONTROLLER, p) for p in SAVE_POINTS]
    cells += [Cell(FaultKind.KILL_CONTROLLER, p) for p in RESTORE_POINTS]
    cells += [Cell(FaultKind.KILL_CLUSTER, p) for p in SAVE_POINTS if p.startswith("after_")]
    cells += [Cell(FaultKind.KILL_ACTOR, p, t) for p in ACTOR_POINTS for t in ("agent/1", "resources/0")]
    cells += [Cell(FaultKind.KILL_ACTOR, BETWEEN, t) for t in ("tq/0", "policy/0", "resources/1", "agent/0")]
    for kind in (FaultKind.PAUSE_ACTOR, FaultKind.PAUSE_CLUSTER, *(BROKER_KINDS if broker else ())):
        cells += [Cell(kind, BETWEEN), Cell(kind, "prepare"), Cell(kind, "commit")]
    # The state directory unwritable where the controller and the participants write to it.
    cells += [Cell(FaultKind.STATE_UNWRITABLE, p) for p in ("save_persist", "save_validate", "save_publish")]
    return cells + (broker_restarts_at_every_step() if broker else []) + (node_stops() if nodes else [])


def quick_matrix(*, broker: bool, nodes: bool = False) -> list[Cell]:
    """A short matrix for CI: every fault kind once or twice, at the steps that matter most."""
    cells = [
        Cell(FaultKind.KILL_CONTROLLER, "after_prepare"),
        Cell(FaultKind.KILL_CONTROLLER, "after_publish"),
        Cell(FaultKind.KILL_CONTROLLER, "after_restore_agent"),
        Cell(FaultKind.KILL_CLUSTER, "after_commit"),
        Cell(FaultKind.KILL_CLUSTER, "after_instant"),  # the window over, the cut not yet written
        Cell(FaultKind.KILL_ACTOR, "after_reply_sent:Commit"),
        Cell(FaultKind.KILL_ACTOR, BETWEEN),
        Cell(FaultKind.PAUSE_ACTOR, "prepare"),
        Cell(FaultKind.PAUSE_CLUSTER, BETWEEN),
    ]
    if broker:
        cells += [Cell(FaultKind.BROKER_RESTART, BETWEEN), Cell(FaultKind.BROKER_KILL, BETWEEN)]
        cells += broker_restarts_at_every_step()
    if nodes:
        cells += [
            Cell(FaultKind.NODE_STOP, "save_commit"),
            Cell(FaultKind.NODE_STOP_CONTROLLERS, "save_prepare"),
        ]
    return cells


def plan_cells(cells: Sequence[Cell], seed: int, *, per_workload: int = 4) -> list[WorkloadPlan]:
    """Spread ``cells`` over workloads, at most ``per_workload`` faults each, seeded. A restore point
    needs a restore: it follows a controller kill in the same workload. At most one broker fault and
    two controller kills share a workload (``_conflicts``). Outages at a point have workloads of their
    own (``_plan_outages``)."""
    rng = random.Random(seed)
    pending = list(cells)
    rng.shuffle(pending)
    outages = [c for c in pending if c.outage_at_point]
    pending = [c for c in pending if not c.outage_at_point]
    restores = [c for c in pending if c.step in RESTORE_POINTS]
    others = [c for c in pending if c.step not in RESTORE_POINTS]
    plans: list[WorkloadPlan] = []
    while restores or others:
        plan = WorkloadPlan(index=len(plans), seed=seed * 1000 + len(plans))
        taken: list[Cell] = []
        if restores:
            restore = restores.pop()
            kill = next((c for c in others if c.kind is FaultKind.KILL_CONTROLLER), None)
            if kill is not None:
                others.remove(kill)
                taken.append(kill)
            else:
                taken.append(Cell(FaultKind.KILL_CONTROLLER, "after_publish"))
            taken.append(restore)
        while others and len(taken) < per_workload:
            cell = others[0]
            if _conflicts(cell, taken):
                alternative = next((c for c in others if not _conflicts(c, taken)), None)
                if alternative is None:
                    break
                cell = alternative
            others.remove(cell)
            taken.append(cell)
        for cell in taken:
            _add(plan, cell, rng)
        plans.append(plan)
    return _plan_outages(outages, plans, rng, seed)


def _plan_outages(
    outages: list[Cell], plans: list[WorkloadPlan], rng: random.Random, seed: int
) -> list[WorkloadPlan]:
    """Outages at points, ``OUTAGES_PER_WORKLOAD`` to a workload, in protocol order (each one armed
    once on the controller, so a workload takes them as the run reaches them). A workload of restore
    steps starts with a controller kill after a publish: its next controller restores."""
    for where in ("save", "restore"):
        chosen = sorted(
            (c for c in outages if (c.step in RESTORE_STEP_POINTS) == (where == "restore")),
            key=lambda c: _step_order(c.step),
        )
        size = OUTAGES_PER_WORKLOAD[where]
        groups = [chosen[i :: -(-len(chosen) // size)] for i in range(-(-len(chosen) // size))]
        for group in groups:
            plan = WorkloadPlan(index=len(plans), seed=seed * 1000 + len(plans))
            if where == "restore":
                plan.controller_points.append(ControllerPoint("after_publish", rng.randint(2, 3)))
            for cell in group:
                _add(plan, cell, rng)
            plans.append(plan)
    return plans


def _conflicts(cell: Cell, taken: list[Cell]) -> bool:
    """Faults that would crowd each other out of one workload: two broker faults, two outages at save
    points (a broken state directory and a broker restart, each held while the step runs), a third
    controller kill at a save point (each one costs a restore), a third actor kill or a second of one
    actor."""
    kinds = [c.kind for c in taken]
    if cell.kind in BROKER_KINDS and any(k in BROKER_KINDS for k in kinds):
        return True
    if cell.outage_at_point and any(c.outage_at_point for c in taken):
        return True
    controller = (FaultKind.KILL_CONTROLLER, FaultKind.KILL_CLUSTER)
    saves = sum(1 for c in taken if c.kind in controller and c.step not in RESTORE_POINTS)
    if cell.kind in controller and cell.step not in RESTORE_POINTS and saves >= 2:
        return True
    if cell.kind is FaultKind.KILL_ACTOR:
        kills = [c for c in taken if c.kind is FaultKind.KILL_ACTOR]
        return len(kills) >= 2 or any(c.target is None or c.target == cell.target for c in kills)
    return False


def _add(plan: WorkloadPlan, cell: Cell, rng: random.Random) -> None:
    if cell.outage_at_point:
        nth = 1 if cell.step in RESTORE_STEP_POINTS else rng.randint(2, 3)
        plan.outage_points.append(OutagePoint(cell.step, cell.kind, BROKER_OUTAGE_S, nth))
    elif cell.kind in (FaultKind.KILL_CONTROLLER, FaultKind.KILL_CLUSTER):
        nth = 1 if cell.step in RESTORE_POINTS else rng.randint(2, 4)
        plan.controller_points.append(
            ControllerPoint(cell.step, nth, cluster=cell.kind is FaultKind.KILL_CLUSTER)
        )
    elif cell.kind is FaultKind.KILL_ACTOR and cell.step != BETWEEN:
        address = cell.target or rng.choice(PARTICIPANTS)
        plan.actor_points.append(ActorPoint(address, cell.step, rng.randint(2, 4)))
    else:
        target = {
            FaultKind.KILL_ACTOR: lambda: cell.target or rng.choice(PARTICIPANTS),
            FaultKind.PAUSE_ACTOR: lambda: rng.choice((*PARTICIPANTS, "controller")),
            FaultKind.PAUSE_CLUSTER: lambda: "cluster",
            FaultKind.BROKER_RESTART: lambda: "broker",
            FaultKind.BROKER_KILL: lambda: "broker",
        }[cell.kind]()
        hold = (
            round(rng.uniform(1.0, 4.0), 2)
            if cell.kind in (FaultKind.PAUSE_ACTOR, FaultKind.PAUSE_CLUSTER)
            else 0.0
        )
        at_step = None if cell.step == BETWEEN else cell.step
        plan.timed.append(TimedFault(cell.kind, target, round(rng.uniform(1.0, 5.0), 2), at_step, hold))


def random_plan(index: int, seed: int, *, broker: bool, nodes: bool = False) -> WorkloadPlan:
    """One workload of a long run: one to three faults drawn from the full matrix, and now and then a
    death during the restore that follows a controller kill."""
    rng = random.Random(seed * 1000 + index)
    cells = [
        c for c in matrix(broker=broker, nodes=nodes) if c.step not in (*RESTORE_POINTS, *RESTORE_STEP_POINTS)
    ]
    wanted = rng.randint(1, 3)
    chosen: list[Cell] = []
    for cell in rng.sample(cells, len(cells)):
        if len(chosen) == wanted:
            break
        if not _conflicts(cell, chosen):
            chosen.append(cell)
    killed = any(c.kind in (FaultKind.KILL_CONTROLLER, FaultKind.KILL_CLUSTER) for c in chosen)
    if killed and rng.random() < 0.3:
        chosen.append(Cell(FaultKind.KILL_CONTROLLER, rng.choice(RESTORE_POINTS)))
    elif (
        killed
        and broker
        and not any(c.kind in BROKER_KINDS or c.outage_at_point for c in chosen)
        and rng.random() < 0.3
    ):
        chosen.append(Cell(FaultKind.BROKER_RESTART, rng.choice(RESTORE_STEP_POINTS)))
    plan = WorkloadPlan(index=index, seed=seed * 1000 + index)
    for cell in chosen:
        _add(plan, cell, rng)
    return plan


def outage_plan(kind: FaultKind, down_s: float, seed: int, *, index: int = 0) -> WorkloadPlan:
    """One workload with one outage of ``down_s`` at a save point drawn from ``seed``."""
    rng = random.Random(seed)
    point = OutagePoint(rng.choice(SAVE_POINTS), kind, down_s, rng.randint(2, 3))
    return WorkloadPlan(index=index, seed=seed * 1000 + index, outage_points=[point])


# -- where the controller is: read from its history ---------------------------------------------
_SNAP_END = (SnapshotDone, SnapshotFailed, SnapshotAborted, SnapshotSkipped)


def controller_step(records: Iterable[Record]) -> str:
    """What the controller was doing after these records (its own, in order): the save step in
    progress, a restore, start-up, or ``BETWEEN`` snapshots."""
    step = "start-up"
    for record in records:
        if isinstance(record, SnapshotStep):
            step = record.step
        elif isinstance(record, (*_SNAP_END, RunStarted)):
            step = BETWEEN
        elif isinstance(record, RestoreStarted):
            step = "restore"
        elif isinstance(record, RunFinished):
            step = "finished"
    return step


# -- the table ----------------------------------------------------------------------------------
@dataclass
class Injected:
    """One fault that really happened, with the workload it happened in."""

    workload: int
    kind: str
    target: str
    step: str  # the point, or the step the controller's history showed
    t: float
    detail: str = ""
    exact: bool = True  # a fault point: the step is exact; else read from the controller's history
    ended: float | None = None  # an outage: when the broker or the state directory was back

    def to_json(self) -> dict[str, Any]:
        return {
            "ended": self.ended,
            "workload": self.workload,
            "kind": self.kind,
            "target": self.target,
            "step": self.step,
            "t": self.t,
            "detail": self.detail,
            "exact": self.exact,
        }


def relabel(faults: Iterable[Injected], records: list[Record]) -> None:
    """Give each timed fault the step the controller's history (``records``, its own, in time order)
    shows at its moment, and keep the step it was planned at in its detail."""
    for fault in faults:
        if fault.exact:
            continue
        before = [r for r in records if r.t <= fault.t]
        latest = before[-1].inc if before else None
        seen = controller_step(r for r in before if r.inc == latest)
        fault.detail = (fault.detail + f" planned {fault.step}").strip()
        fault.step = seen if seen == BETWEEN else f"during {seen}"


def table_rows(injected: Iterable[Injected], passed: dict[int, bool]) -> list[dict[str, Any]]:
    """Fault kind by step: how many times it ran, in how many workloads, and the outcome (``pass`` when
    every workload it ran in passed the history checker)."""
    cells: dict[tuple[str, str], list[Injected]] = defaultdict(list)
    for fault in injected:
        cells[(fault.kind, fault.step)].append(fault)
    order = {kind.value: i for i, kind in enumerate(FaultKind)}
    rows = []
    for (kind, step), faults in sorted(
        cells.items(), key=lambda kv: (order.get(kv[0][0], 99), _step_order(kv[0][1]))
    ):
        workloads = sorted({f.workload for f in faults})
        failed = [w for w in workloads if not passed.get(w, False)]
        rows.append(
            {
                "fault": kind,
                "step": step,
                "runs": len(faults),
                "workloads": len(workloads),
                "outcome": "pass" if not failed else f"FAIL (workload {', '.join(map(str, failed))})",
                "targets": sorted({f.target for f in faults}),
            }
        )
    return rows


def _step_order(step: str) -> tuple[int, str]:
    base = step.split(":")[0]
    for prefix in ("save_", "after_"):
        if base.startswith(prefix) and base[len(prefix) :] in SAVE_STEPS:
            return (SAVE_STEPS.index(base[len(prefix) :]) * 2 + (prefix == "after_"), step)
    if base in SAVE_STEPS:
        return (SAVE_STEPS.index(base) * 2, step)
    if step in RESTORE_STEP_POINTS:
        return (100 + RESTORE_STEP_POINTS.index(step), step)
    if step in RESTORE_POINTS:
        return (150 + RESTORE_POINTS.index(step), step)
    return (200, step)


def render_table(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown."""
    lines = ["| fault | protocol step | on | runs | workloads | outcome |", "|---|---|---|---:|---:|---|"]
    for row in rows:
        on = ", ".join(row["targets"])
        lines.append(
            f"| {row['fault']} | {row['step']} | {on} | {row['runs']} | {row['workloads']} | {row['outcome']} |"
        )
    return "\n".join(lines)
