"""Outages at a save step, on a real cluster of processes and a real throwaway RabbitMQ node.

Issue 14: a broker restart during ``prepare`` killed the run, and a state directory unwritable for a
few seconds ended it ("3 snapshots failed in a row"). Each test here is one chaos workload
(``parkway chaos``'s harness, ``run_chaos``) with one outage at a save step drawn from the seed: the
controller stops itself at that exact fault point (``=STOP``), the harness takes the broker down (or
puts a file where the run's snapshot directory was), lets the controller go on under the outage for
60 s, and repairs it. The run must complete by itself (no controller exit, nothing restarted), every
rollout sealed exactly once along the surviving timeline, no mutation applied twice or lost (the
history checker over every process: every bank balance verified), work sealed after the outage was
over, and the transcripts those of the same workload run without a fault.

The 3 s broker outage at every save and restore step is in the seeded run of ``test_chaos.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from parkway.actors.chaos.nemesis import Options, run_chaos
from parkway.actors.chaos.results import WorkloadResult
from parkway.actors.chaos.schedule import SAVE_POINTS, FaultKind, WorkloadPlan, outage_plan
from parkway.actors.launch.rabbit_node import rabbitmq_bin
from parkway.actors.runtime.history import read_history
from parkway.protocol.history import RolloutSealed, SnapshotDone
from parkway.protocol.layout import COMPLETED

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

SEED = 14  # the number: which save step each outage lands on
DOWN_S = 60.0


async def one_outage(tmp_path: Path, kind: FaultKind, **options: float) -> tuple[WorkloadResult, list]:
    assert rabbitmq_bin() is not None, "an outage test owns a RabbitMQ node: it needs RabbitMQ's scripts"
    plan = outage_plan(kind, DOWN_S, SEED)
    [planned] = plan.outage_points
    assert planned.point in SAVE_POINTS
    result = await run_chaos(
        Options(
            seed=SEED,
            workdir=tmp_path / "chaos",
            plans=[plan, WorkloadPlan(index=1, seed=plan.seed)],  # the same workload, no fault
            keep_passing=True,
            workload_timeout_s=DOWN_S + 240.0,
            **options,
        )
    )
    workload, unbroken = result.workloads
    report = workload.verdict.report() if workload.verdict is not None else ""
    assert workload.error is None, f"{workload.error}\nnotes: {workload.notes}\n{report}"
    [fault] = workload.faults  # the outage happened, at the step drawn
    assert (fault.kind, fault.step, fault.ended is not None) == (kind.value, planned.point, True)
    # The run went through the outage by itself: no controller exited, no actor was restarted.
    assert workload.controllers == 1 and workload.notes == [], workload.notes
    assert workload.passed, report
    summary = workload.summary
    assert summary is not None and summary["rollouts_sealed"] == summary["rollouts_expected"] == 12
    assert summary["rollouts_failed"] == 0 and summary["mean_reward"] == 1.0
    assert unbroken.summary is not None and unbroken.faults == []
    assert summary["transcripts_sha256"] == unbroken.summary["transcripts_sha256"]
    assert workload.verdict is not None and workload.verdict.stats["seals"] == 12
    records = read_history(tmp_path / "chaos" / workload.run / "state" / "history" / workload.run)
    assert fault.ended is not None
    return workload, records


def sealed_after(records: list, t: float) -> list:
    return [r for r in records if isinstance(r, RolloutSealed) and r.t > t]


@pytest.mark.timeout(900)
async def test_a_60s_broker_outage_at_a_save_step_loses_and_doubles_nothing(tmp_path: Path) -> None:
    workload, records = await one_outage(tmp_path, FaultKind.BROKER_RESTART)
    [fault] = workload.faults
    assert fault.ended is not None and sealed_after(records, fault.ended), (
        "nothing was sealed after the outage: it proves nothing about going on after one"
    )


@pytest.mark.timeout(900)
async def test_a_state_directory_unwritable_for_60s_does_not_end_the_run(tmp_path: Path) -> None:
    # Rollouts go on while snapshots fail. Slower tokens keep the run going past the outage, so a
    # snapshot after it shows that saving came back; on a quick machine the run may finish while the
    # directory is still a file, and then it must have waited to write its completion marker.
    workload, records = await one_outage(tmp_path, FaultKind.STATE_UNWRITABLE, token_delay_s=0.08)
    [fault] = workload.faults
    assert fault.ended is not None
    during = [r for r in sealed_after(records, fault.t) if r.t < fault.ended]
    assert during, "nothing was sealed while the state directory was unwritable: the rollouts stopped"
    if sealed_after(records, fault.ended):
        published = [r for r in records if isinstance(r, SnapshotDone) and r.t > fault.ended]
        assert published, "no snapshot was published after the outage"
    else:
        marker = tmp_path / "chaos" / workload.run / "state" / "snapshots" / workload.run / COMPLETED
        assert float(marker.read_text()) > fault.ended, "the completion marker was not written after it"
