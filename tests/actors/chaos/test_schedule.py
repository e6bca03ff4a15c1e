"""The nemesis's plan and table: pure, seeded, and covering what it says it covers."""

from __future__ import annotations

from collections import Counter

import msgspec
from parkway.actors.chaos.schedule import (
    BETWEEN,
    BROKER_OUTAGE_S,
    NODE_KINDS,
    OUTAGES_PER_WORKLOAD,
    RESTORE_POINTS,
    RESTORE_STEP_POINTS,
    SAVE_POINTS,
    ActorPoint,
    ControllerPoint,
    FaultKind,
    Injected,
    OutagePoint,
    controller_step,
    matrix,
    outage_plan,
    plan_cells,
    quick_matrix,
    random_plan,
    relabel,
    render_table,
    table_rows,
)
from parkway.protocol.history import Record, RestoreStarted, RunStarted, SnapshotDone, SnapshotStep
from parkway.protocol.snapshot import RESTORE_SEQUENCE


def cells_of(plans) -> list[tuple[str, str]]:
    """The (fault kind, step) cells a list of plans injects, as the table will name them."""
    cells = []
    for plan in plans:
        cells += [(p.kind.value, p.point) for p in plan.controller_points]
        cells += [(FaultKind.KILL_ACTOR.value, p.point) for p in plan.actor_points]
        cells += [(t.kind.value, t.at_step or BETWEEN) for t in plan.timed]
        cells += [(o.kind.value, o.point) for o in plan.outage_points]
    return cells


def test_the_full_matrix_covers_every_step_of_save_and_restore_for_controller_kills() -> None:
    cells = {(c.kind, c.step) for c in matrix(broker=True)}
    killed = {c.target for c in matrix(broker=True) if c.kind is FaultKind.KILL_ACTOR}
    assert {t.split("/")[0] for t in killed if t} == {"tq", "policy", "resources", "agent"}
    assert {(FaultKind.KILL_CONTROLLER, p) for p in SAVE_POINTS + RESTORE_POINTS} <= cells
    assert len(SAVE_POINTS) == 24  # 12 save steps, at the start and at the end of each
    assert all(kind in {c.kind for c in matrix(broker=True, nodes=True)} for kind in FaultKind)
    assert not {c.kind for c in matrix(broker=False)} & {FaultKind.BROKER_RESTART, FaultKind.BROKER_KILL}
    assert not {c.kind for c in matrix(broker=True)} & NODE_KINDS  # node stops only on a cluster
    stopped = {(c.kind, c.step) for c in matrix(broker=False, nodes=True) if c.kind in NODE_KINDS}
    assert stopped == {(kind, p) for kind in NODE_KINDS for p in SAVE_POINTS}


def test_planning_places_every_cell_once_and_is_repeatable() -> None:
    for cells in (matrix(broker=True), quick_matrix(broker=True), quick_matrix(broker=False, nodes=True)):
        plans = plan_cells(cells, seed=5)
        wanted = Counter((c.kind.value, c.step) for c in cells)
        placed = Counter(cells_of(plans))
        assert not wanted - placed  # every cell is placed
        # ... once; a restore point with no controller kill left to follow gets one of its own.
        assert set((placed - wanted).elements()) <= {("kill_controller", "after_publish")}
        assert plan_cells(cells, seed=5) == plans
        assert plan_cells(cells, seed=6) != plans


def test_a_restore_point_follows_a_controller_kill_in_its_workload() -> None:
    for plan in plan_cells(matrix(broker=True), seed=3):
        points = [p.point for p in plan.controller_points]
        for index, point in enumerate(points):
            if point in RESTORE_POINTS:
                assert index > 0 and points[index - 1] not in RESTORE_POINTS, plan.describe()


def test_a_workload_gets_at_most_one_broker_fault_two_save_kills_and_two_actor_kills() -> None:
    for plan in plan_cells(matrix(broker=True), seed=11) + [
        random_plan(i, 4, broker=True) for i in range(50)
    ]:
        brokers = [t for t in plan.timed if t.kind in (FaultKind.BROKER_RESTART, FaultKind.BROKER_KILL)]
        if len(plan.outage_points) > 1:  # a workload of outages at points holds nothing else but one kill
            assert not brokers and not plan.actor_points and len(plan.controller_points) <= 1
        else:
            brokers += [o for o in plan.outage_points if o.kind is not FaultKind.STATE_UNWRITABLE]
        save_kills = [p for p in plan.controller_points if p.point not in RESTORE_POINTS]
        assert len(brokers) <= 1 and len(save_kills) <= 2, plan.describe()
        killed = [p.address for p in plan.actor_points] + [
            t.target for t in plan.timed if t.kind is FaultKind.KILL_ACTOR
        ]
        assert len(killed) <= 2 and len(set(killed)) == len(killed), plan.describe()


def test_random_plans_are_seeded() -> None:
    assert [random_plan(i, 9, broker=True).describe() for i in range(10)] == [
        random_plan(i, 9, broker=True).describe() for i in range(10)
    ]
    assert random_plan(0, 9, broker=True).describe() != random_plan(0, 10, broker=True).describe()
    assert all(random_plan(i, 9, broker=True).describe() != "no faults" for i in range(30))


def test_fault_points_are_armed_with_their_count() -> None:
    assert ControllerPoint("after_commit", 3).spec == "after_commit@3"
    assert ControllerPoint("after_commit", 3, cluster=True).kind is FaultKind.KILL_CLUSTER
    assert ActorPoint("agent/1", "participant_prepare", 2).spec == "participant_prepare:agent@2"
    assert ActorPoint("tq/0", "after_reply_sent:Commit", 4).spec == "after_reply_sent:Commit@4"


def stamped(record: Record, t: float) -> Record:
    """A controller's record at time ``t``, as its history file would hold it."""
    return msgspec.structs.replace(record, t=t, n=int(t * 100), actor="controller/0", pid=1, inc="1")


def test_the_controller_step_is_read_from_its_history() -> None:
    assert controller_step([]) == "start-up"
    history = [
        stamped(RunStarted(restored=False, epoch=1, expected=()), 1.0),
        stamped(SnapshotStep(checkpoint_id="ck-1", step="instant"), 1.1),
        stamped(SnapshotStep(checkpoint_id="ck-1", step="prepare"), 1.2),
    ]
    assert controller_step(history) == "prepare"
    done = SnapshotDone(checkpoint_id="ck-1", snapshot="snapshot_1")
    assert controller_step([*history, stamped(done, 1.3)]) == BETWEEN
    restore = RestoreStarted(restore_id="rs-1", snapshot="snapshot_1", saved_checkpoint_id="ck-1")
    assert controller_step([*history, stamped(restore, 1.4)]) == "restore"


def test_a_timed_fault_is_relabelled_with_the_step_the_controller_was_in() -> None:
    history = [
        stamped(RunStarted(restored=False, epoch=1, expected=()), 1.0),
        stamped(SnapshotStep(checkpoint_id="ck-1", step="prepare"), 1.2),
        stamped(SnapshotDone(checkpoint_id="ck-1", snapshot="snapshot_1"), 1.5),
    ]
    during = Injected(0, "pause_actor", "tq/0", "prepare", 1.3, exact=False)
    between = Injected(0, "kill_actor", "tq/0", BETWEEN, 1.6, detail="hold 1s", exact=False)
    exact = Injected(0, "kill_controller", "controller", "after_commit", 1.3)
    relabel([during, between, exact], history)
    assert (during.step, during.detail) == ("during prepare", "planned prepare")
    assert (between.step, between.detail) == (BETWEEN, f"hold 1s planned {BETWEEN}")
    assert (exact.step, exact.detail) == ("after_commit", "")


def test_the_table_counts_runs_and_fails_a_cell_whose_workload_failed() -> None:
    injected = [
        Injected(0, "kill_controller", "controller", "after_commit", 1.0),
        Injected(1, "kill_controller", "controller", "after_commit", 2.0),
        Injected(1, "pause_actor", "tq/0", "during prepare", 2.5, exact=False),
        Injected(2, "kill_controller", "controller", "save_prepare", 3.0),
    ]
    rows = table_rows(injected, {0: True, 1: False, 2: True})
    assert [(r["fault"], r["step"], r["runs"], r["workloads"], r["outcome"]) for r in rows] == [
        ("kill_controller", "save_prepare", 1, 1, "pass"),
        ("kill_controller", "after_commit", 2, 2, "FAIL (workload 1)"),
        ("pause_actor", "during prepare", 1, 1, "FAIL (workload 1)"),
    ]
    text = render_table(rows)
    assert text.splitlines()[0] == "| fault | protocol step | on | runs | workloads | outcome |"
    assert "| kill_controller | after_commit | controller | 2 | 2 | FAIL (workload 1) |" in text
    assert "| pause_actor | during prepare | tq/0 | 1 | 1 | FAIL (workload 1) |" in text


def test_ci_restarts_the_broker_at_every_step_of_save_and_restore() -> None:
    # Issue 14: the broker restarted at random times never caught a restart during prepare; the
    # seeded CI run now restarts it at the start and end of every save step and at every restore step.
    assert tuple(f"restore_{step.name.value}" for step in RESTORE_SEQUENCE) == RESTORE_STEP_POINTS
    for cells in (quick_matrix(broker=True), matrix(broker=True)):
        at_points = {c.step for c in cells if c.kind is FaultKind.BROKER_RESTART and c.outage_at_point}
        assert at_points == set(SAVE_POINTS) | set(RESTORE_STEP_POINTS)
    assert not [c for c in quick_matrix(broker=False) if c.outage_at_point]
    plans = plan_cells(quick_matrix(broker=True), seed=1)
    outages = [o for plan in plans for o in plan.outage_points]
    assert sorted(o.point for o in outages) == sorted(SAVE_POINTS + RESTORE_STEP_POINTS)  # each once
    assert {(o.kind, o.down_s) for o in outages} == {(FaultKind.BROKER_RESTART, BROKER_OUTAGE_S)}
    for plan in plans:
        points = [o for o in plan.outage_points]
        restore = [o for o in points if o.in_restore]
        if restore:  # restore steps need a restore: the workload kills its first controller
            assert restore == points and [p.kind for p in plan.controller_points] == [
                FaultKind.KILL_CONTROLLER
            ]
            assert all(o.nth == 1 for o in restore) and len(restore) <= OUTAGES_PER_WORKLOAD["restore"]
        else:
            assert len(points) <= OUTAGES_PER_WORKLOAD["save"] and all(o.nth >= 2 for o in points)


def test_an_outage_point_stops_the_controller_there() -> None:
    point = OutagePoint("save_prepare", FaultKind.BROKER_RESTART, 60.0, 2)
    assert (point.spec, point.target, point.in_restore) == ("save_prepare=STOP@2", "broker", False)
    restore = OutagePoint("restore_discover", FaultKind.STATE_UNWRITABLE, 60.0)
    assert (restore.spec, restore.target, restore.in_restore) == ("restore_discover=STOP@1", "state", True)


def test_a_long_outage_lands_on_a_save_point_drawn_from_the_seed() -> None:
    plan = outage_plan(FaultKind.BROKER_RESTART, 60.0, seed=14)
    [point] = plan.outage_points
    assert point.point in SAVE_POINTS and point.down_s == 60.0 and point.nth >= 2
    assert outage_plan(FaultKind.BROKER_RESTART, 60.0, seed=14) == plan
    drawn = {outage_plan(FaultKind.STATE_UNWRITABLE, 60.0, seed=s).outage_points[0].point for s in range(40)}
    assert len(drawn) > 5  # the seed moves it over the save steps


def test_a_fault_at_a_step_fires_when_that_step_started_lately_not_only_when_it_is_the_newest() -> None:
    # CI's seeded schedule: "pause_actor at prepare" waited for prepare to be the controller's newest
    # step at a 20 ms poll; prepare takes a few milliseconds since the window shrank, so it never was,
    # and the pause (and the pause queued behind it) never fired.
    import time

    from parkway.actors.chaos.nemesis import started_lately
    from parkway.protocol.history import SnapshotStep

    now = time.time()
    steps = ["retire", "ack_drain", "instant", "prepare", "prepared", "drain_receipts", "capture"]
    records = [
        SnapshotStep(checkpoint_id="ck-1", step=s, t=now - 0.05 + i * 0.005) for i, s in enumerate(steps)
    ]
    assert started_lately(records, "prepare")  # started 35 ms ago, no longer the newest step
    assert not started_lately(records, "publish")  # not started at all
    old = [SnapshotStep(checkpoint_id="ck-0", step="prepare", t=now - 5.0)]
    assert not started_lately(old + records[4:], "prepare")  # started, but too long ago
