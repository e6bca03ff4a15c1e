"""History records: the typed union reads the files the untyped writer wrote, and writes the same lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from parkway.protocol.history import (
    KINDS,
    HistoryFormatError,
    Receipt,
    Refused,
    RolloutSealed,
    RowStaged,
    SnapshotInstalled,
    encode_line,
    parse_line,
    record_from_fields,
)

# One record of each (kind, role) as an embedded crash-and-restore run wrote them before the records
# were typed (the run of tests/actors/test_history_check.py::test_a_real_crash_and_restore_passes).
BEFORE_TYPES = Path(__file__).with_name("history_before_types.jsonl")

_COMMON = {"t": 1.5, "n": 3, "actor": "x/0", "pid": 7, "inc": "7"}
# The kinds that run does not make, each as its writer's fields made them (for the controller's, the
# keyword arguments of its calls).
OTHER_KINDS = [
    {"k": "refused", "actor": "policy/0", "r": "t0000_g0", "a": 0, "code": "stale_attempt"},
    {"k": "refused", "actor": "tq/0", "ck": "t0000_g0-a1", "i": 2, "code": "stale_attempt"},
    {"k": "aborted", "r": "t0000_g0", "a": 1, "request": "t0000_g0-a1:3"},
    {"k": "duplicate", "r": "t0000_g0", "a": 0, "i": 2, "tool": "transfer"},
    {"k": "stalled", "r": "t0000_g0", "a": 0},
    {"k": "unsealed", "actor": "tq/0", "r": "t0000_g0", "a": 0, "ck": "t0000_g0"},
    {"k": "replica_restarted", "replica": 1, "lost": ["t0000_g0", "t0001_g2"]},
    {"k": "orphan_aborted", "cid": "ck-1", "participants": ["agent/0", "tq/0"]},
    {"k": "snap_skipped", "cid": "ck-1"},
    {"k": "snap_failed", "cid": "ck-1", "step": "prepare", "detail": "storage: full", "transient": True},
    {"k": "snap_aborted", "cid": "ck-1", "step": "prepare"},
    {"k": "restore_failed", "rid": "rs-1", "step": "restore_tq"},
    {"k": "fault", "fault": "kill_actor", "target": "tq/0", "step": "between snapshots", "detail": ""},
    {"k": "unplanned_exit", "target": "controller", "code": -9},
    {"k": "unplanned_exit", "target": "agent/1", "code": None},
]


def old_lines() -> list[bytes]:
    others = [json.dumps({**_COMMON, **line}).encode() for line in OTHER_KINDS]
    return BEFORE_TYPES.read_bytes().splitlines() + others


def test_every_kind_is_in_the_files_of_this_test() -> None:
    assert {json.loads(line)["k"] for line in old_lines()} == set(KINDS)


@pytest.mark.parametrize("line", old_lines(), ids=lambda line: json.loads(line)["k"])
def test_a_line_written_before_the_types_reads_and_writes_back_the_same(line: bytes) -> None:
    record = parse_line(line, "before")
    assert type(record) is KINDS[json.loads(line)["k"]]
    assert json.loads(encode_line(record)) == json.loads(line)  # same keys, same values
    assert record.to_json() == json.loads(line)
    assert parse_line(encode_line(record)) == record


def test_the_attributes_say_what_the_short_names_are() -> None:
    seal = parse_line(
        b'{"t":2.0,"n":9,"k":"seal","actor":"controller/0","pid":1,"inc":"1",'
        b'"r":"t0000_g1","a":2,"ck":"t0000_g1-a2","reward":1,"seq":4}'
    )
    assert seal == RolloutSealed(
        t=2.0,
        n=9,
        actor="controller/0",
        pid=1,
        inc="1",
        rollout_id="t0000_g1",
        attempt=2,
        capture_key="t0000_g1-a2",
        reward=1.0,
        seq=4,
    )
    assert (seal.kind, seal.role) == ("seal", "controller")
    assert seal.line(1.0) == (
        "    1.000s controller/0          1 seal               r=t0000_g1 a=2 ck=t0000_g1-a2 reward=1.0 seq=4"
    )


def test_a_field_only_some_writers_set_is_left_out_of_the_line_when_unset() -> None:
    from_policy = Refused(rollout_id="g_g0", attempt=1, code="stale_attempt")
    assert set(json.loads(encode_line(from_policy))) == {*_COMMON, "k", "r", "a", "code"}
    from_tq = Refused(capture_key="g_g0-a1", turn=0, code="stale_attempt")
    assert set(json.loads(encode_line(from_tq))) == {*_COMMON, "k", "ck", "i", "code"}
    # ... while a None its writer set is written, as before.
    receipt = Receipt(rollout_id="g_g0", attempt=0, of="completed", code=None, turns=3)
    assert json.loads(encode_line(receipt))["code"] is None
    assert set(json.loads(encode_line(SnapshotInstalled(epoch=2, stopped=0, continuing=1)))) == {
        *_COMMON,
        "k",
        "epoch",
        "stopped",
        "continuing",
    }


def test_fields_from_their_file_names_are_checked_against_the_kind() -> None:
    assert record_from_fields("staged", ck="g_g0", i=1) == RowStaged(capture_key="g_g0", turn=1)
    with pytest.raises(HistoryFormatError, match="unknown record kind 'stage'"):
        record_from_fields("stage", ck="g_g0", i=1)
    with pytest.raises(HistoryFormatError, match="a staged record has no field turn"):
        record_from_fields("staged", ck="g_g0", turn=1)
    with pytest.raises(HistoryFormatError, match="a staged record: Object missing required field `i`"):
        record_from_fields("staged", ck="g_g0")
    with pytest.raises(HistoryFormatError, match=r"a staged record: Expected `int`, got `str` - at `\$.i`"):
        record_from_fields("staged", ck="g_g0", i="1")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"t":1.0,"n":1,"k":"staged"', "here: not JSON"),
        (b"[1, 2]", "here: a record needs the fields t, n, k, actor, pid, inc"),
        (b'{"t":1.0,"n":1,"k":"nope","actor":"a/0","pid":1,"inc":"1"}', "here: unknown record kind 'nope'"),
        (
            b'{"t":1.0,"n":1,"k":"staged","actor":"a/0","pid":1,"inc":"1","ck":"x"}',
            "here: a staged record: Object missing required field `i`",
        ),
        (
            b'{"t":"soon","n":1,"k":"staged","actor":"a/0","pid":1,"inc":"1","ck":"x","i":0}',
            r"here: a staged record: Expected `float`, got `str` - at `\$.t`",
        ),
    ],
)
def test_a_line_that_is_no_record_says_why(line: bytes, message: str) -> None:
    with pytest.raises(HistoryFormatError, match=message):
        parse_line(line, "here")
