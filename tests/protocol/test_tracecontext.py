"""The trace context parkway reads and the trace ids it derives."""

from __future__ import annotations

import pytest
from parkway.protocol.tracecontext import (
    ParentContext,
    checkpoint_span_id,
    checkpoint_trace_id,
    format_traceparent,
    parse_published_at,
    parse_traceparent,
    rollout_trace_id,
)

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_names_its_parent_and_round_trips() -> None:
    parent = parse_traceparent(VALID)
    assert parent == ParentContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, True)
    assert format_traceparent(parent.trace_id, parent.span_id) == VALID


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        VALID.upper(),  # the spec's ids are lower-case hex
        VALID + "-extra",
        "ff" + VALID[2:],  # version ff is forbidden, and we read version 00 only
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero span id
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # one hex digit short
        VALID.replace("-", "_"),
        "00-" + "a" * 10_000,  # oversized: refused before the pattern runs
        VALID + "\n",
        "\x00" * 55,
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # not text
        55,
    ],
)
def test_anything_else_is_no_parent(value: object) -> None:
    assert parse_traceparent(value) is None


def test_published_at_is_a_recent_finite_time_or_nothing() -> None:
    assert parse_published_at("100.5", now=101.0) == 100.5
    for bad in (None, "", "nan", "inf", "-inf", "1e400", "x", "1" * 40, "100000000"):
        assert parse_published_at(bad, now=101.0) is None, bad


def test_trace_ids_are_derived_stable_and_distinct() -> None:
    assert checkpoint_trace_id("ck-1") == checkpoint_trace_id("ck-1") != checkpoint_trace_id("ck-2")
    assert 0 < checkpoint_trace_id("ck-1") < 2**128 and 0 < checkpoint_span_id("ck-1") < 2**64
    assert rollout_trace_id("t0_g0", 0) != rollout_trace_id("t0_g0", 1) != rollout_trace_id("t0_g1", 1)
