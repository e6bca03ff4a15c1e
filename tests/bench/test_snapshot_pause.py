"""The snapshot pause benchmark's variant machinery (``bench/snapshot_pause.py``): names to workloads,
the rotated rounds, steps read from whatever the records name, the medians over rounds and the issue's
ratios. The clusters themselves are the benchmark's (minutes over RabbitMQ); no time is asserted."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is scripts

import snapshot_pause as bench
from parkway.actors.run.config import from_dict
from parkway.actors.run.tasks import load_tasks


def test_a_variant_is_named_by_what_it_changes() -> None:
    def parse(name: str) -> bench.Variant:
        return bench.parse_variant(name, tool_delay_s=0.1, turns=12)

    assert parse("n256") == bench.Variant("n256", 256, 0.1, 12)
    assert parse("n256-tools5s") == bench.Variant("n256-tools5s", 256, 5.0, 12)
    assert parse("n64-tools250ms-turns50") == bench.Variant("n64-tools250ms-turns50", 64, 0.25, 50)
    assert parse("n1024-turns5").turns == 5
    at_one_rate = parse("n1024-rate256")
    assert at_one_rate.rate == 256 and at_one_rate.per_token_delay_s(0.05) == pytest.approx(0.2)
    assert parse("n256").per_token_delay_s(0.05) == 0.05  # no rate: the engine's own time per token
    for bad in ("256", "n0", "n16-turns0", "n16-tools5", "n16-turns5-tools1s", "x16", "n16-rate0"):
        with pytest.raises(ValueError, match="variant"):
            parse(bad)
    names = [parse(n) for n in bench.DEFAULT_VARIANTS]
    for check in bench.CHECKS:  # the default set has every variant the issue's figures need
        assert {check.variant, check.over} - {None} <= {v.name for v in names}


def test_every_round_runs_every_variant_once_in_a_rotated_order() -> None:
    variants = [bench.parse_variant(n, tool_delay_s=0.1, turns=12) for n in ("n16", "n256", "n1024")]
    orders = [[v.name for v in bench.round_order(variants, r)] for r in range(4)]
    assert orders == [
        ["n16", "n256", "n1024"],
        ["n256", "n1024", "n16"],
        ["n1024", "n16", "n256"],
        ["n16", "n256", "n1024"],
    ]


def test_the_workload_runs_every_rollout_for_exactly_the_variants_turns() -> None:
    args = argparse.Namespace(prompts=0, delay=0.05)
    variant = bench.parse_variant("n256-tools5s-turns50", tool_delay_s=0.1, turns=12)
    config = from_dict(bench.workload(variant, args))
    assert config.rollout.max_turns == 50 and config.rollout.max_in_flight == 256
    assert config.resources.tool_delay_s == 5.0 and config.policy.per_token_delay_s == 0.05
    tasks = load_tasks(config.tasks)
    assert len(tasks) * config.rollout.group_size >= 4 * 256  # never runs dry during a point
    assert {t.max_turns for t in tasks} == {None}  # no task cuts its rollouts short
    assert config.agent == "tool"  # it calls a tool each turn; the engine answers on the last one only


def record(pause: float, steps: dict[str, float], park_wait: float | None = 10.0) -> dict[str, Any]:
    made: dict[str, Any] = {"pause_ms": pause, "rollouts": 3, "bytes": 1000, "steps_ms": steps}
    if park_wait is not None:
        made["park_wait_ms"] = park_wait
    return made


def test_steps_are_whatever_the_records_name_in_the_order_they_come() -> None:
    records = [
        record(40.0, {"prepare": 10.0, "commit": 20.0}),
        record(60.0, {"prepare": 30.0, "persist": 5.0, "commit": 10.0}),  # a new step, later
    ]
    assert bench.steps_seen(records) == ["prepare", "commit", "persist"]
    point = bench.summarize(records, failed=0)
    assert point["steps_ms_p50"] == {"prepare": 20.0, "commit": 15.0, "persist": 5.0}
    assert point["pause_without_park_wait_ms"]["p50"] == 40.0
    without_waits = bench.summarize([record(40.0, {"save": 1.0}, park_wait=None)], failed=0)
    assert without_waits["park_wait_ms"] is None and without_waits["pause_without_park_wait_ms"] is None


def test_snapshots_that_waited_for_receipts_are_counted_apart() -> None:
    records = [record(10.0 + i, {"drain_receipts": 1.0}) for i in range(9)]
    records += [record(300.0, {"drain_receipts": 250.0}), record(20.0, {"drain_receipts": 20.0})]
    made = bench.summarize(records, failed=0)
    assert made["drained"] == 1  # over 20 ms only
    assert made["pause_undrained_ms"]["p95"] < 25.0 < made["pause_ms"]["p95"]
    assert bench.summarize([record(40.0, {"prepare": 1.0})], failed=0)["drained"] == 0  # no such step
    none_left = bench.summarize([record(300.0, {"drain_receipts": 250.0})], failed=0)
    assert none_left["drained"] == 1 and none_left["pause_undrained_ms"] is None


def point(name: str, round_index: int, p95: float, steps: dict[str, float]) -> dict[str, Any]:
    made = bench.summarize([record(p95 / 2, steps), record(p95, steps)], failed=0)
    made["pause_ms"]["p95"] = p95  # the figure the ratios are made of, exactly
    made.update(
        variant=name,
        mode="rabbitmq",
        round=round_index,
        load_1m=[1.0, 1.5],
        turns_done_at_first_snapshot=6.0,
        tool_calls_running=[2, 4],
        seconds=40.0,
    )
    return made


def test_medians_over_rounds_and_the_issues_ratios_two_ways() -> None:
    names = ("n16", "n256", "n1024", "n256-tools5s", "n256-turns5", "n256-turns50")
    variants = [bench.parse_variant(n, tool_delay_s=0.1, turns=12) for n in names]
    p95s = {
        "n16": [10.0, 20.0, 30.0],
        "n256": [40.0, 60.0, 50.0],
        "n1024": [20.0, 20.0, 90.0],  # per round 2.0, 1.0, 3.0: median 2.0; of medians 20 / 20 = 1.0
        "n256-tools5s": [400.0, 600.0, 500.0],
        "n256-turns5": [40.0, 40.0, 40.0],
        "n256-turns50": [44.0, 48.0, 52.0],
    }
    points = [
        point(name, r, p95, {"prepare": 1.0 + r, "commit": 2.0} if r else {"prepare": 1.0, "publish": 3.0})
        for name, values in p95s.items()
        for r, p95 in enumerate(values)
    ]
    rows = {r["variant"]: r for r in bench.aggregate(points, variants, ["rabbitmq"])}
    assert rows["n256"]["pause_p95_ms"] == 50.0 and rows["n256"]["rounds"] == 3
    assert rows["n256"]["pause_p95_ms_by_round"] == {0: 40.0, 1: 60.0, 2: 50.0}
    assert rows["n256"]["drained"] == 0 and rows["n256"]["pause_p95_undrained_ms"] is not None
    assert list(rows["n16"]["steps_ms_p50"]) == ["prepare", "publish", "commit"]
    assert rows["n16"]["steps_ms_p50"] == {"prepare": 2.0, "publish": 3.0, "commit": 2.0}
    assert rows["n16"]["tool_calls_running"] == {"min": 2, "p50": 3.0}
    found = {c["variant"]: c for c in bench.checks(list(rows.values()))}
    assert found["n256"]["median_of_rounds"] == 50.0 and found["n256"]["within"]["median_of_rounds"]
    assert found["n1024"]["by_round"] == {0: 2.0, 1: 1.0, 2: 3.0}
    assert found["n1024"]["median_of_rounds"] == 2.0 and found["n1024"]["of_medians"] == 1.0
    assert found["n1024"]["within"] == {"median_of_rounds": False, "of_medians": True}
    assert found["n256-tools5s"]["median_of_rounds"] == 10.0
    assert found["n256-turns50"]["median_of_rounds"] == 1.2 and found["n256-turns50"]["within"]["of_medians"]
    assert "n16" not in found  # the denominator of a ratio is not a figure of its own
    table = bench.table(list(rows.values())) + bench.checks_table(list(found.values()))
    assert "persist" not in table and "publish" in table and "NO" in table
    partial = bench.checks([r for name, r in rows.items() if name in ("n16", "n256")])
    assert [c["variant"] for c in partial] == ["n256"]  # a ratio whose variants did not run is left out


def test_a_baseline_is_another_builds_parkway_measured_beside_this_one(tmp_path: Path) -> None:
    assert bench.builds_compared(None) == [("", None)]  # alone: the points run in this process
    with pytest.raises(SystemExit, match="no parkway package"):
        bench.builds_compared(str(tmp_path))
    (tmp_path / "parkway").mkdir()
    [(this, _), (other, path)] = bench.builds_compared(str(tmp_path))
    assert (this, other, path) == ("", "@baseline", str(tmp_path))


def test_only_the_roles_off_the_window_are_started_with_a_lowered_priority() -> None:
    import cluster
    from parkway.actors.runtime.settings import NICE_ENV
    from parkway.protocol.snapshot import SAVE_SEQUENCE, SaveStep

    assert cluster.NICE_ENV == NICE_ENV  # spelt out there for a baseline build without it
    # The cut (its instant, then the ledger's copy) awaits only the agents' answers (TQ's commands at
    # capture are sent, not awaited).
    until_copied = SAVE_SEQUENCE[: [s.name for s in SAVE_SEQUENCE].index(SaveStep.CAPTURE)]
    awaited = {role for step in until_copied for stage in step.stages for role in stage}
    assert awaited == {"agent"} and not awaited & set(bench.OFF_WINDOW_ROLES)
    nice = dict.fromkeys(bench.OFF_WINDOW_ROLES, 10)
    run = {"PARKWAY_RUN": "r"}
    envs = {
        role: cluster.actor_env(run, role, ("agent",), nice)
        for role in ("agent", "policy", "resources", "tq")
    }
    assert {role: env.get(NICE_ENV) for role, env in envs.items()} == {
        "agent": None,
        "policy": "10",
        "resources": "10",
        "tq": "10",
    }
    assert envs["agent"]["PARKWAY_HISTORY"] == "1" and "PARKWAY_HISTORY" not in envs["tq"]
    assert cluster.actor_env(run, "tq", (), dict.fromkeys(bench.OFF_WINDOW_ROLES, 0)) == run
