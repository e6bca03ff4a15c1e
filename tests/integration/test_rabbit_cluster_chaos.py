"""A run on a real three-node RabbitMQ cluster with quorum queues, losing a broker node in the middle
of a snapshot: every actor and the controller its own process (``parkway chaos``'s harness), each
connected to one node and failing over along its list of the three.

Two workloads, each with one node stopped at a save step (the controller stops itself at that fault
point, the harness stops the node, lets the controller go on without it for a while, starts it again):
first a node the controller is not connected to (some actors are), then the controller's own. The run
must go through by itself (no process restarted, no controller exit), every rollout sealed once along
the timeline, no tool mutation applied twice or lost (the history checker over every process), and
the transcripts equal to the same workload's with no fault.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from parkway.actors.chaos.nemesis import Options, run_chaos
from parkway.actors.chaos.schedule import FaultKind, OutagePoint, WorkloadPlan
from parkway.actors.launch.rabbit_node import rabbitmq_bin

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.slow,
    pytest.mark.skipif(rabbitmq_bin() is None, reason="needs the scripts of a local RabbitMQ installation"),
]

SEED = 18
DOWN_S = 8.0
STEPS = {FaultKind.NODE_STOP: "save_commit", FaultKind.NODE_STOP_CONTROLLERS: "save_prepare"}


@pytest.mark.timeout(900)
async def test_a_run_loses_a_broker_node_mid_snapshot_and_completes_exactly_once(tmp_path: Path) -> None:
    plans = [
        WorkloadPlan(index=index, seed=SEED, outage_points=[OutagePoint(step, kind, DOWN_S, 2)])
        for index, (kind, step) in enumerate(STEPS.items())
    ]
    plans.append(WorkloadPlan(index=len(plans), seed=SEED))  # the same workload, no fault
    result = await run_chaos(
        Options(
            seed=SEED,
            workdir=tmp_path / "chaos",
            broker_nodes=3,
            plans=plans,
            keep_passing=True,
            workload_timeout_s=300.0,
        )
    )
    *broken, unbroken = result.workloads
    # The reference: the same workload without a fault (its verdict fails only for injecting none).
    assert unbroken.summary is not None and unbroken.faults == [] and unbroken.error is None
    for workload, (kind, step) in zip(broken, STEPS.items(), strict=True):
        report = workload.verdict.report() if workload.verdict is not None else ""
        assert workload.error is None, f"{kind}: {workload.error}\nnotes: {workload.notes}\n{report}"
        [fault] = workload.faults  # the node was stopped, at that step, and started again
        assert (fault.kind, fault.step, fault.ended is not None) == (kind.value, step, True)
        assert workload.controllers == 1 and workload.notes == [], workload.notes  # nothing restarted
        assert workload.passed, report  # the history checker: sealed once, no mutation twice or lost
        summary = workload.summary
        assert summary is not None and summary["rollouts_sealed"] == summary["rollouts_expected"] == 12
        assert summary["rollouts_failed"] == 0 and summary["mean_reward"] == 1.0
        assert summary["transcripts_sha256"] == unbroken.summary["transcripts_sha256"]
        assert workload.verdict is not None and workload.verdict.stats["seals"] == 12
        # The stopped node's clients went over to another node: the controller's own when its node
        # stopped, only actors' when another did.
        logs = tmp_path / "chaos" / workload.run / "logs"
        failed_over = sorted(p.name for p in logs.glob("*.log") if "broker_failover" in p.read_text())
        assert failed_over, f"{kind}: no process failed over to another node"
        assert any(name.startswith("controller") for name in failed_over) == (
            kind is FaultKind.NODE_STOP_CONTROLLERS
        ), failed_over
