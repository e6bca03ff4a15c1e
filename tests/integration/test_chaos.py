"""The nemesis on a real cluster: separate processes on a real RabbitMQ, killed and paused for real.

The first test is the short seeded schedule CI runs: ``parkway chaos`` itself, as a process, on a
throwaway RabbitMQ node it owns (so it can restart and kill the broker too). Every run must show that
faults were injected, that every workload finished with every rollout sealed, and that the history
checker passed every invariant over every process's history. It restarts the broker (down 3 s) at
the start and the end of every save step and at the start of every restore step, the controller
stopped at that exact fault point while the harness takes the broker down (issue 14: restarts at
random times never caught the restart during ``prepare`` that ended runs).

The others replay, each with one exact fault, what the harness found: they failed before the fix named
in each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from parkway.actors.chaos.nemesis import Options, run_chaos
from parkway.actors.chaos.schedule import (
    BROKER_OUTAGE_S,
    RESTORE_STEP_POINTS,
    SAVE_POINTS,
    ActorPoint,
    FaultKind,
    TimedFault,
    WorkloadPlan,
    quick_matrix,
)
from parkway.actors.launch.processes import clean_environment
from parkway.actors.launch.rabbit_node import rabbitmq_bin
from parkway.actors.runtime.history import read_history
from parkway.protocol.history import Receipt, ReplicaRestarted

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

SEED = 1
RUN_TIMEOUT_S = 1500  # eight workloads, five of them of 3 s broker outages at every step


@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
def test_a_short_seeded_chaos_schedule_passes_the_history_checker(tmp_path: Path) -> None:
    assert rabbitmq_bin() is not None, "the chaos test owns a RabbitMQ node: it needs RabbitMQ's scripts"
    env = clean_environment()
    command = ["chaos", "--seed", str(SEED), "--json", "--quiet", "--workdir", str(tmp_path / "chaos")]
    with subprocess.Popen(
        [sys.executable, "-m", "parkway.actors", *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as chaos:
        try:
            out, err = chaos.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            chaos.terminate()  # SIGTERM: the harness reaps every process it started and stops its node
            out, err = chaos.communicate(timeout=240)
            pytest.fail(f"parkway chaos ran past {RUN_TIMEOUT_S}s: {err[-4000:]}")
    assert chaos.returncode == 0, failed_workloads(out) + err[-4000:]
    result = json.loads(out)
    assert result["passed"] and result["broker"] == "own node"

    # Work was done, under every fault the short matrix plans, and all of it was checked.
    planned = {(c.kind.value, c.step) for c in quick_matrix(broker=True)}
    ran = {(row["fault"], row["step"]) for row in result["table"]}
    assert {kind for kind, _ in planned} == {kind for kind, _ in ran}  # every fault kind happened
    exact = {cell for cell in planned if cell[0] in ("kill_controller", "kill_cluster")}
    assert exact <= ran  # the controller died at every step it was asked to
    # ... and the broker went down at every step of a save and of a restore, each exactly once.
    outages = [
        f
        for w in result["workloads"]
        for f in w["faults"]
        if f["step"] in RESTORE_STEP_POINTS + SAVE_POINTS and f["kind"] == "broker_restart"
    ]
    assert sorted(f["step"] for f in outages) == sorted(SAVE_POINTS + RESTORE_STEP_POINTS)
    assert all(f["detail"] == f"{BROKER_OUTAGE_S:.0f}s down" and f["ended"] > f["t"] for f in outages)
    restored = {f["workload"] for f in outages if f["step"] in RESTORE_STEP_POINTS}
    assert all(result["workloads"][w]["controllers"] >= 2 for w in restored)  # a restore, not a start
    # A short outage ends nothing: no process exited on its own in those workloads (the harness would
    # start it again and hide it), and a restore that met one went on (one controller killed, one more).
    for index in sorted({f["workload"] for f in outages}):
        workload = result["workloads"][index]
        assert workload["notes"] == [], (workload["plan"], workload["notes"])
        assert workload["controllers"] == (2 if index in restored else 1), workload["plan"]
    assert result["faults_injected"] >= len(planned)
    assert all(row["outcome"] == "pass" for row in result["table"])
    for workload in result["workloads"]:
        summary, verdict = workload["summary"], workload["verdict"]
        assert workload["passed"] and workload["faults"], workload["plan"]
        assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 12
        assert summary["rollouts_failed"] == 0 and summary["mean_reward"] == 1.0
        assert verdict["ok"] and [c["name"] for c in verdict["checks"] if not c["ok"]] == []
        assert verdict["stats"]["seals"] == 12 and verdict["stats"]["faults"] == len(workload["faults"])
    assert sum(w["controllers"] for w in result["workloads"]) > len(result["workloads"])  # controllers died
    assert sum(w["verdict"]["stats"]["restores"] for w in result["workloads"]) >= 3  # ... and restored


async def one_fault(tmp_path: Path, url: str, plan: WorkloadPlan):
    result = await run_chaos(
        Options(seed=plan.seed, workdir=tmp_path / "chaos", broker_url=url, plans=[plan], keep_passing=True)
    )
    [workload] = result.workloads
    assert workload.passed, workload.error or (workload.verdict.report() if workload.verdict else "")
    assert len(workload.faults) == 1, workload.plan
    return workload


def history_of(tmp_path: Path, run: str):
    return read_history(tmp_path / "chaos" / run / "state" / "history" / run)


async def test_a_resources_server_killed_alone_loses_no_mutation(amqp_url: str, tmp_path: Path) -> None:
    # Found by the checker (mutations_exactly_once): the new resources process answered the rest of a
    # running rollout from a fresh session, the transfers before the crash were lost, and the rollout
    # sealed with reward 0.0. Now a session never opens mid-way: those rollouts fail (stale_attempt) and
    # are redone from their prompt.
    plan = WorkloadPlan(0, 41, timed=[TimedFault(FaultKind.KILL_ACTOR, "resources/0", at_s=3.0)])
    workload = await one_fault(tmp_path, amqp_url, plan)
    assert workload.summary is not None and workload.summary["attempts_failed"] >= 1
    assert workload.summary["mean_reward"] == 1.0
    refused = [r for r in history_of(tmp_path, workload.run) if isinstance(r, Receipt) and r.code]
    assert refused and all(r.code == "stale_attempt" for r in refused)


async def test_an_agent_killed_alone_has_its_attempts_fenced_everywhere(
    amqp_url: str, tmp_path: Path
) -> None:
    # Found by the checker (fenced_attempts_stay_fenced): after an agent died, the policy kept generating
    # its attempts' calls and TQ kept their rows after the controller had dispatched their next attempts.
    plan = WorkloadPlan(0, 42, timed=[TimedFault(FaultKind.KILL_ACTOR, "agent/1", at_s=3.0)])
    workload = await one_fault(tmp_path, amqp_url, plan)
    records = history_of(tmp_path, workload.run)
    [restarted] = [r for r in records if isinstance(r, ReplicaRestarted)]
    assert restarted.lost, "the agent died with rollouts running, or this case proves nothing"
    fenced = {r.actor for r in records if r.kind == "fence" and r.t > restarted.t}
    assert {"policy/0", "resources/0", "resources/1", "tq/0"} <= fenced


async def test_an_agent_dead_after_journaling_its_prepare_reply_fails_one_snapshot_not_the_run(
    amqp_url: str, tmp_path: Path
) -> None:
    # Found by the harness (an unplanned controller exit): the new agent process replayed the journaled
    # Prepared, then refused the Commit (invalid_phase), which the controller took for a broken protocol
    # and ended the run. A participant that restarted during the snapshot is a transient failure.
    plan = WorkloadPlan(0, 43, actor_points=[ActorPoint("agent/1", "after_reply_journaled:Prepare", 2)])
    workload = await one_fault(tmp_path, amqp_url, plan)
    assert workload.controllers == 1 and workload.notes == []
    assert workload.summary is not None and workload.summary["snapshots_failed"] >= 1


def failed_workloads(out: str) -> str:
    """What a failed chaos run says about the workloads that failed (the whole JSON is too long to
    read in CI's output): each one's plan, error, notes and failing checks."""
    try:
        result = json.loads(out)
    except ValueError:
        return out[-4000:]
    lines = []
    for workload in result.get("workloads", []):
        verdict = workload.get("verdict") or {}
        failing = [c for c in verdict.get("checks", []) if not c.get("ok")]
        if workload.get("passed") and not failing:
            continue
        lines.append(
            json.dumps(
                {k: workload.get(k) for k in ("index", "plan", "error", "notes", "controllers")}
                | {"failing_checks": failing}
            )[:3000]
        )
    return "\n".join(lines) or out[-4000:]
