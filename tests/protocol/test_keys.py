"""The rollout, capture and staging keys: each parser takes apart exactly what its builder makes."""

from __future__ import annotations

import pytest
from parkway.protocol.ids import (
    capture_key,
    parse_capture_key,
    parse_group_session,
    parse_rollout_id,
    parse_staging_key,
    parse_task_group_id,
    rollout_id,
    staging_key,
    task_group_id,
)


def test_a_task_group_id_is_its_index_in_four_digits() -> None:
    assert [task_group_id(i) for i in (0, 3, 9999, 10000)] == ["t0000", "t0003", "t9999", "t10000"]
    assert parse_rollout_id(rollout_id(task_group_id(12), 2)) == ("t0012", 2)
    with pytest.raises(ValueError, match="negative"):
        task_group_id(-1)


@pytest.mark.parametrize("index", [0, 3, 9999, 10000, 123456])
def test_a_task_group_id_parses_back_to_its_index(index: int) -> None:
    assert parse_task_group_id(task_group_id(index)) == index


@pytest.mark.parametrize("value", ["", "t", "0003", "t003", "t00012", "tx", "t-001", "t²²²²", "g0001"])
def test_a_group_id_no_builder_makes_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="is not t<task index"):
        parse_task_group_id(value)


@pytest.mark.parametrize(("group", "index"), [("t0000", 0), ("t0003", 12), ("grp_g7", 1), ("a-a1", 3)])
def test_a_rollout_id_parses_back_to_its_group_and_index(group: str, index: int) -> None:
    assert parse_rollout_id(rollout_id(group, index)) == (group, index)


@pytest.mark.parametrize(
    "value", ["", "t0000", "_g1", "t0000_g", "t0000_g01", "t0000_gx", "t0000_g-1", "t_g²"]
)
def test_a_rollout_id_without_a_group_or_index_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="is not <group id>_g<index>"):
        parse_rollout_id(value)


@pytest.mark.parametrize("attempt", [0, 1, 2, 10, 123])
@pytest.mark.parametrize("logical", ["t0000_g1", "g_g0", "r1", "x-a", "a:b_g2"])
def test_a_capture_key_parses_back_to_its_rollout_and_attempt(logical: str, attempt: int) -> None:
    assert parse_capture_key(capture_key(logical, attempt)) == (logical, attempt)


def test_capture_keys_as_the_ledger_writes_them() -> None:
    assert parse_capture_key("t0000_g1") == ("t0000_g1", 0)
    assert parse_capture_key("t0000_g1-a2") == ("t0000_g1", 2)
    assert parse_capture_key("t0000_g1-a") == ("t0000_g1-a", 0)  # no count: not an attempt suffix


@pytest.mark.parametrize("key", ["t0000_g1-a0", "t0000_g1-a02", "-a3"])
def test_a_capture_key_no_builder_makes_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="is not <rollout id>"):
        parse_capture_key(key)


def test_an_empty_capture_key_is_refused_both_ways() -> None:
    with pytest.raises(ValueError, match="capture key is empty"):
        parse_capture_key("")
    with pytest.raises(ValueError, match="needs a rollout id"):
        capture_key("", 1)
    with pytest.raises(ValueError, match="negative"):
        capture_key("g_g0", -1)


@pytest.mark.parametrize("turn", [0, 1, 9, 40])
@pytest.mark.parametrize("capture", ["g_g0", "g_g0-a3", "odd:key"])
def test_a_staging_key_parses_back_to_its_capture_key_and_turn(capture: str, turn: int) -> None:
    key = staging_key(capture, turn)
    assert key == f"{capture}:{turn}"
    assert parse_staging_key(key) == (capture, turn)


@pytest.mark.parametrize(
    "key", ["", "g_g0", "g_g0:", ":3", "g_g0:x", "g_g0:-1", "g_g0:01", "g_g0:²", "g_g0:t1"]
)
def test_a_staging_key_without_a_capture_key_or_turn_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="is not <capture key>:<turn>"):
        parse_staging_key(key)


def test_a_staging_key_needs_a_capture_key_and_a_turn() -> None:
    with pytest.raises(ValueError, match="needs a capture key"):
        staging_key("", 0)
    with pytest.raises(ValueError, match="negative"):
        staging_key("g_g0", -1)


def test_a_session_tag_in_a_group_id_parses_back_and_nothing_else_does() -> None:
    assert task_group_id(3, 17) == "t0003s17" and parse_group_session("t0003s17") == (3, 17)
    assert parse_group_session("t0003") == (3, 0) and parse_task_group_id("t0003s17") == 3
    assert parse_rollout_id(rollout_id(task_group_id(3, 17), 1)) == ("t0003s17", 1)
    for bad in ("t0003s0", "t0003s", "t0003s01", "t003s1", "s1", "t0003s1s2"):
        with pytest.raises(ValueError):
            parse_group_session(bad)
