"""``bench/prepare_hops.py``: the prepare step's parts, read from span records as the file exporter
writes them, for the agent whose reply came last; snapshots far apart are different points."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is scripts

import prepare_hops


def span(trace: str, name: str, actor: str, start: float, end: float, **attrs: Any) -> dict[str, Any]:
    return {
        "event": "span",
        "trace_id": trace,
        "name": name,
        "actor": actor,
        "start": start,
        "end": end,
        "attrs": attrs,
    }


def snapshot(trace: str, t: float, slow_back: float) -> list[dict[str, Any]]:
    """A prepare step of 20 ms: agent/0 answers at once, agent/1's reply takes ``slow_back`` back."""
    records = [span(trace, "prepare", "controller/0", t, t + 0.020)]
    for agent, queued_from, back in (("agent/0", 0.001, 0.001), ("agent/1", 0.002, slow_back)):
        at = {"parkway.actor": agent}
        records += [
            span(
                trace,
                "queued Prepare",
                agent,
                t + queued_from,
                t + 0.006,
                **at,
                **{"parkway.phase": "queued"},
            ),
            span(trace, "Prepare", agent, t + 0.006, t + 0.009, **at, **{"parkway.phase": "handled"}),
            span(
                trace,
                f"reply Prepared from {agent}",
                "controller/0",
                t + 0.010,
                t + 0.010 + back,
                **{"parkway.actor": "controller/0", "parkway.replier": agent, "parkway.phase": "reply"},
            ),
        ]
    return records


def test_the_slowest_agents_round_trip_in_parts_and_points_split_by_time() -> None:
    t = 1_796_552_105.0
    records = snapshot("a", t, 0.008) + snapshot("b", t + 2, 0.006) + snapshot("c", t + 200, 0.004)
    records.append({"event": "log", "trace_id": "a"})  # not a span: ignored
    found = prepare_hops.hops(records)
    assert [round(at - t) for at, _ in found] == [0, 2, 200]
    first = found[0][1]
    expected = {"out": 2, "queued": 4, "handled": 3, "after": 1, "back": 8, "rest": 2, "step": 20}
    assert {k: v * 1000 for k, v in first.items()} == pytest.approx(expected, abs=1e-3)  # ms
    groups = prepare_hops.points(found)
    assert [len(g) for g in groups] == [2, 1]  # 200 s later: another benchmark point


def test_a_step_without_its_agents_spans_is_left_out() -> None:
    t = 1_796_552_105.0
    lone = [span("x", "prepare", "controller/0", t, t + 0.010)]
    assert prepare_hops.hops(lone) == []


def test_what_the_slowest_agent_finished_while_its_prepare_was_queued() -> None:
    t = 1_796_552_105.0
    records = snapshot("a", t, 0.008)  # agent/1's Prepare queued from t+2 ms to t+6 ms
    at = {"parkway.actor": "agent/1"}
    records += [
        span("r1", "turn 7", "agent/1", t - 0.5, t + 0.003, **at),  # ended while queued: counted
        span("r1", "tool call 7", "agent/1", t - 0.1, t + 0.004, **at),
        span("r2", "turn 3", "agent/1", t - 0.5, t + 0.005, **at),
        span("r2", "turn 4", "agent/1", t + 0.005, t + 0.050, **at),  # ended after its handler began
        span("r3", "turn 2", "agent/0", t - 0.5, t + 0.003, **{"parkway.actor": "agent/0"}),  # another agent
    ]
    [step] = prepare_hops.slowest(records)
    assert (step.agent, step.queued_from - t, step.queued_to - t) == (
        "agent/1",
        pytest.approx(0.002, abs=1e-6),
        pytest.approx(0.006, abs=1e-6),
    )
    assert prepare_hops.work_while_queued(records, step) == {"turn": 2, "tool call": 1}
