"""Every message round-trips through both encodings; bad bytes get the right typed error."""

from __future__ import annotations

import time

import msgspec
import pytest
from parkway.protocol import SCHEMA_VERSION, codec
from parkway.protocol import messages as m
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.ids import capture_key, is_valid_checkpoint_id, rollout_id

NOW = 1_800_000_000.0
ATTEMPT = m.AttemptRef(rollout_id="g1_g0", attempt=1)
EPISODE = m.EpisodeRef(rollout_id="g1_g0", attempt=1, replica=0)

EXAMPLES: list[m.Message] = [
    m.Discover(checkpoint_id="ck-1", deadline=NOW),
    m.Status(checkpoint_id="status-1", deadline=NOW),
    m.Prepare(checkpoint_id="ck-1", deadline=NOW, episodes=(EPISODE,), base="ck-0"),
    m.Renew(checkpoint_id="ck-1", deadline=NOW),
    m.Commit(checkpoint_id="ck-1", deadline=NOW, location="tmp_ck-1", episodes=(EPISODE,)),
    m.Persist(checkpoint_id="ck-1", deadline=NOW, location="tmp_ck-1"),
    m.Resume(checkpoint_id="ck-1", deadline=NOW),
    m.Abort(checkpoint_id="ck-1", deadline=NOW, reason="agent/1 unreachable"),
    m.Restore(checkpoint_id="rs-1", deadline=NOW, location="snapshot_12", episodes=(EPISODE,)),
    m.Retire(checkpoint_id="ck-1", deadline=NOW, attempts=(ATTEMPT,)),
    m.Forget(checkpoint_id="ck-1", deadline=NOW, attempts=(ATTEMPT,)),
    m.Probe(checkpoint_id="p-1", deadline=NOW, work_s=0.5, note="hello"),
    m.Snapshot(checkpoint_id="snap-req-1", deadline=NOW),
    m.SnapshotTaken(snapshot="snapshot_3", checkpoint_id="ck-3"),
    m.LoadWeights(checkpoint_id="w-1", deadline=NOW, directory="/ckpt/step-4", policy_version=4),
    m.WeightsLoaded(policy_version=4, directory="/ckpt/step-4", replicas=2, seconds=1.5),
    m.Error(code=ErrorCode.STALE_CHECKPOINT, detail="ended", retryable=False),
    m.Ok(detail="resumed"),
    m.Capabilities(role="resources", replica=1, mode="restart_only", restart_only=True, features=("x",)),
    m.StatusReport(role="agent", replica=0, run="r", pid=1, phase="idle", counts={"Status": 2}),
    m.Prepared(
        checkpoint_id="ck-1",
        parked=3,
        boundaries_passed=7,
        restarts=(ATTEMPT,),
        episodes=(m.EpisodeRef(rollout_id="g1_g0", attempt=1, replica=0, tools=4),),
    ),
    m.Prepared(  # what changed in an agent's cut since the cut of ck-0
        checkpoint_id="ck-1", parked=3, episodes=(EPISODE,), base="ck-0", gone=(ATTEMPT,)
    ),
    m.Committed(checkpoint_id="ck-1", episodes=(EPISODE,)),
    m.Persisted(
        checkpoint_id="ck-1", files=(m.FileDigest(path="a.msgpack", sha256="0" * 64, records=2, size=10),)
    ),
    m.Restored(checkpoint_id="rs-1", rollouts=(ATTEMPT,)),
    m.ProbeResult(pid=7, executions=1),
    m.MemoryReport(checkpoint_id="mem-1", deadline=1e9, top=3, start=True),
    m.MemoryUsage(
        pid=7,
        rss_bytes=1 << 20,
        tracing=True,
        top=(m.Allocation(file="a.py", line=3, size_bytes=100, count=2),),
        structures={"sessions": 4},
    ),
    m.Run(
        rollout_id="g1_g0",
        attempt=0,
        group_id="g1",
        env="counter",
        prompt="add 2",
        task=m.TaskOptions(agent="counter", resources=1, continue_from=2),
        seed=3,
    ),
    m.Generate(rollout_id="g1_g0", attempt=0, call_index=2, token_ids=(1, 2, 3), seed=3, stop_token_ids=(0,)),
    m.Generated(rollout_id="g1_g0", attempt=0, call_index=2, token_ids=(4, 5), logprobs=(-0.1, -0.2)),
    m.ToolCall(
        rollout_id="g1_g0", attempt=0, call_index=3, env="bank", tool="transfer", arguments={"amount": 5}
    ),
    m.ToolResult(rollout_id="g1_g0", attempt=0, call_index=3, ok=True, output={"balance": 10}, revision=4),
    m.Rows(rows=(m.StagingRow(capture_key="g1_g0", turn=0, token_ids=(1,), logprobs=(-0.5,)),)),
    m.SealRows(rollout_id="g1_g0", attempt=0, capture_key="g1_g0", reward=1.0),
    m.FetchRows(rollout_ids=("g1_g0",)),
    m.ReleaseRows(rollout_ids=("g1_g0", "g1_g1")),
    m.CanonicalRows(
        rows=(
            m.CanonicalRow(
                rollout_id="g1_g0",
                attempt=0,
                capture_key="g1_g0",
                reward=1.0,
                turns=(m.StagingRow(capture_key="g1_g0", turn=0, token_ids=(1,)),),
            ),
        ),
        missing=("g2_g0",),
    ),
    m.Completed(rollout_id="g1_g0", attempt=0, capture_key="g1_g0", reward=1.0, turns=5),
    m.Ack(receipts=(ATTEMPT,)),
    m.Failed(rollout_id="g1_g0", attempt=0, code="max_turns", detail="no answer after 8 turns"),
    m.Train(
        session="tr-1",
        step=2,
        groups=(m.TrainGroup(group_id="g1", task_index=1, sealed=("g1_g0",), failed=("g1_g1",)),),
    ),
    m.Trained(
        step=2,
        policy_version=3,
        groups=1,
        samples=1,
        failed=1,
        mean_reward=1.0,
        tokens=12,
        rollouts=(m.TrainedRollout(rollout_id="g1_g0", reward=1.0, digest="ab" * 32),),
    ),
    m.TrainerSync(session="tr-1", step=1),
    m.TrainerAt(step=1, policy_version=2, dropped=1),
]


def test_examples_cover_every_message_type() -> None:
    assert {type(e).__name__ for e in EXAMPLES} == set(m.MESSAGE_TYPES)


@pytest.mark.parametrize("content_type", [codec.MSGPACK, codec.JSON])
@pytest.mark.parametrize("message", EXAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(message: m.Message, content_type: str) -> None:
    body = codec.encode(message, content_type)
    assert codec.decode(body, content_type) == message


def test_json_is_tagged_and_versioned_so_a_script_can_write_it() -> None:
    body = b'{"type": "Prepare", "v": 1, "checkpoint_id": "ck-7", "deadline": 1800000000}'
    assert codec.decode(body, "application/json") == m.Prepare(checkpoint_id="ck-7", deadline=NOW)
    assert codec.decode(body, None) == m.Prepare(checkpoint_id="ck-7", deadline=NOW)  # sniffed
    assert msgspec.json.decode(codec.encode(m.Ok(), codec.JSON)) == {
        "type": "Ok",
        "v": SCHEMA_VERSION,
        "detail": "",
    }


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        EXAMPLES[2].checkpoint_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("body", "code", "fragment"),
    [
        (b"\xc1\xc1", ErrorCode.INVALID_MESSAGE, "not a parkway message"),
        (b'{"type": "Prepare"', ErrorCode.INVALID_MESSAGE, "not a parkway message"),
        (b'{"type": "Launch", "v": 1}', ErrorCode.INVALID_MESSAGE, "unknown message type 'Launch'"),
        (
            b'{"type": "Prepare", "v": 2, "checkpoint_id": "a", "deadline": 1}',
            ErrorCode.UNSUPPORTED_VERSION,
            "version 2",
        ),
        (b'{"type": "Prepare", "checkpoint_id": "a", "deadline": 1}', ErrorCode.INVALID_MESSAGE, "`v`"),
        (b'{"type": "Prepare", "v": 1, "checkpoint_id": "a"}', ErrorCode.INVALID_MESSAGE, "deadline"),
        (
            b'{"type": "Prepare", "v": 1, "checkpoint_id": "a", "deadline": "soon"}',
            ErrorCode.INVALID_MESSAGE,
            "deadline",
        ),
        (
            b'{"type": "Prepare", "v": 1, "checkpoint_id": "a", "deadline": 1, "x": 1}',
            ErrorCode.INVALID_MESSAGE,
            "unknown field",
        ),
        (
            b'{"type": "Prepare", "v": 1, "checkpoint_id": "../etc", "deadline": 1}',
            ErrorCode.INVALID_MESSAGE,
            "checkpoint id",
        ),
        (
            b'{"type": "Prepare", "v": 1, "checkpoint_id": "a", "deadline": 1, "base": "../x"}',
            ErrorCode.INVALID_MESSAGE,
            "base",
        ),
        (
            # Attempts that left a cut, with no cut named that they left (protocol.cut_changes).
            b'{"type": "Prepared", "v": 1, "checkpoint_id": "a", "gone": [{"rollout_id": "r", "attempt": 0}]}',
            ErrorCode.INVALID_MESSAGE,
            "no base cut",
        ),
        (
            b'{"type": "Commit", "v": 1, "checkpoint_id": "a", "deadline": 1, "location": "../../x"}',
            ErrorCode.INVALID_MESSAGE,
            "location",
        ),
        (
            b'{"type": "Ack", "v": 1, "receipts": [{"rollout_id": "r", "attempt": -1}]}',
            ErrorCode.INVALID_MESSAGE,
            ">= 0",  # a range checked at decode (protocol.ranges)
        ),
        (
            # Found by the fuzz test: the keys made of a rollout id are correlation ids (255 bytes at
            # most on AMQP); a longer one failed the policy's handler as it sent the staging row.
            b'{"type": "Generate", "v": 1, "rollout_id": "' + b"\xc3\xbc" * 65 + b'", "attempt": 0, '
            b'"call_index": 0, "token_ids": [1]}',
            ErrorCode.INVALID_MESSAGE,
            "longer than 128 bytes",
        ),
        (b"[1, 2, 3]", ErrorCode.INVALID_MESSAGE, "not a parkway message"),
        # Found by fuzzing: a MessagePack string that is not UTF-8 (msgspec raises UnicodeDecodeError).
        (b"\x82\xa4type\xa6Status\xa1v\x97", ErrorCode.INVALID_MESSAGE, "not a parkway message"),
        (
            b"\x84\xa4type\xa6Status\xa1v\x01\xadcheckpoint_id\xa2\xff\xfe\xa8deadline\x01",
            ErrorCode.INVALID_MESSAGE,
            "invalid Status",
        ),
    ],
)
def test_bad_bodies_get_typed_errors(body: bytes, code: ErrorCode, fragment: str) -> None:
    with pytest.raises(ProtocolError) as info:
        codec.decode(body, codec.JSON if body[:1] in b"{[" else codec.MSGPACK)
    assert info.value.code is code
    assert fragment in info.value.detail


def test_unknown_content_type_and_oversized_bodies_are_refused() -> None:
    with pytest.raises(ProtocolError, match="content type"):
        codec.decode(b"{}", "text/xml")
    with pytest.raises(ProtocolError, match="exceeds the limit") as caught:
        codec.decode(b" " * (codec.MAX_BODY_BYTES + 1), codec.JSON)
    assert (
        caught.value.detail
        == f"body of {16 * 1024 * 1024 + 1} bytes exceeds the limit of {16 * 1024 * 1024} bytes"
    )
    with pytest.raises(ProtocolError, match="body of 1025 bytes exceeds the limit of 1024 bytes"):
        codec.decode(b" " * 1025, codec.JSON, max_bytes=1024)


@pytest.mark.parametrize("value", ["a", "ck-20261129T1000.123-abc", "A.b_c-9", "x" * 128])
def test_valid_checkpoint_ids(value: str) -> None:
    assert is_valid_checkpoint_id(value)


@pytest.mark.parametrize("value", ["", ".", "..", "-a", ".hidden", "a/b", "a b", "x" * 129, "a\x00", "ü"])
def test_invalid_checkpoint_ids(value: str) -> None:
    assert not is_valid_checkpoint_id(value)


def test_rollout_ids_and_capture_keys() -> None:
    logical = rollout_id("grp7", 1)
    assert logical == "grp7_g1"
    assert capture_key(logical, 0) == "grp7_g1"
    assert capture_key(logical, 2) == "grp7_g1-a2"
    with pytest.raises(ValueError):
        capture_key(logical, -1)


def test_deadlines_are_absolute_unix_seconds() -> None:
    prepare = m.Prepare(checkpoint_id="ck", deadline=time.time() + 5)
    assert prepare.deadline > 1_700_000_000


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"directory": "", "policy_version": 1}, "directory is empty"),
        ({"directory": "/w", "policy_version": 0}, "< 1"),
    ],
)
def test_a_weight_update_needs_a_directory_and_a_version(fields: dict, complaint: str) -> None:
    body = msgspec.json.encode(
        {"type": "LoadWeights", "v": 1, "checkpoint_id": "w-1", "deadline": 2e9, **fields}
    )
    with pytest.raises(ProtocolError, match=complaint) as caught:
        codec.decode(body, codec.JSON)
    assert caught.value.code is ErrorCode.INVALID_MESSAGE


def _body(kind: str, **fields: object) -> bytes:
    return msgspec.json.encode({"type": kind, "v": 1, **fields})


RUN_FIELDS = {"rollout_id": "g_g0", "attempt": 0, "group_id": "g", "env": "counter", "prompt": "p"}
CALL_FIELDS = {"rollout_id": "g_g0", "attempt": 0, "call_index": 0}


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        # Found by fuzzing the controller: a receipt of attempt -1 sealed the current attempt (a
        # negative index picks the last one).
        (
            _body("Completed", rollout_id="g_g0", attempt=-1, capture_key="g_g0", reward=1, turns=1),
            r"Expected `int` >= 0 - at `\$.attempt`",
        ),
        (_body("Failed", rollout_id="g_g0", attempt=-2, code="x"), r">= 0 - at `\$.attempt`"),
        (_body("Run", **{**RUN_FIELDS, "attempt": -1}), r">= 0 - at `\$.attempt`"),
        (_body("Run", **{**RUN_FIELDS, "rollout_id": ""}), "rollout_id is empty"),
        (_body("ToolCall", **{**CALL_FIELDS, "call_index": -1}, env="counter", tool="get"), r"\$.call_index"),
        (_body("SealRows", rollout_id="g_g0", attempt=-1, capture_key="g_g0", reward=0), r"\$.attempt"),
        # Found by fuzzing the policy: a token id the engine cannot hash was an internal error.
        (_body("Generate", **CALL_FIELDS, token_ids=[1, -1]), r">= 0 - at `\$.token_ids\[1\]`"),
        (_body("Generate", **CALL_FIELDS, token_ids=[2**63 - 1]), r"<= 2147483647 - at `\$.token_ids\[0\]`"),
        (_body("Generate", **CALL_FIELDS, token_ids=[1], stop_token_ids=[-5]), r"\$.stop_token_ids\[0\]"),
        (_body("Generate", **CALL_FIELDS, token_ids=[1], max_tokens=-1), r">= 0 - at `\$.max_tokens`"),
    ],
)
def test_data_messages_with_impossible_identities_are_refused(body: bytes, complaint: str) -> None:
    with pytest.raises(ProtocolError, match=complaint) as caught:
        codec.decode(body, codec.JSON)
    assert caught.value.code is ErrorCode.INVALID_MESSAGE


@pytest.mark.parametrize(
    ("kind", "checkpoint_id", "location", "complaint"),
    [
        # A commit writes its own checkpoint's temporary directory only: never a published snapshot ...
        ("Commit", "ck-1", "snapshot_1", "not the temporary directory of checkpoint 'ck-1'"),
        # ... nor another checkpoint's files.
        ("Commit", "ck-1", "tmp_ck-2", "not the temporary directory"),
        # A restore reads a published snapshot only.
        ("Restore", "rs-1", "tmp_ck-1", "not a published snapshot"),
        # Paths and tricks: refused by the location's pattern before anything looks at the disk.
        ("Commit", "ck-1", "tmp_ck-1/../../x", "does not match"),
        ("Restore", "rs-1", "/etc", "does not match"),
        ("Restore", "rs-1", "snapshot_1\u2215..", "does not match"),  # a unicode division slash
        ("Restore", "rs-1", "snapshot_\uff11", "does not match"),  # a fullwidth digit
        ("Commit", "ck-1", "tmp_" + "x" * 129, "does not match"),
        ("Commit", "..", "tmp_..", "checkpoint"),
        ("Commit", "ck\u2215..", "tmp_ck\u2215..", "checkpoint"),
        ("Commit", "x" * 129, "tmp_" + "x" * 129, "checkpoint"),
    ],
)
def test_snapshot_locations_cannot_leave_their_place(
    kind: str, checkpoint_id: str, location: str, complaint: str
) -> None:
    body = _body(kind, checkpoint_id=checkpoint_id, deadline=2e9, location=location)
    with pytest.raises(ProtocolError, match=complaint) as caught:
        codec.decode(body, codec.JSON)
    assert caught.value.code is ErrorCode.INVALID_MESSAGE


def test_a_run_s_task_options_read_what_the_controller_always_sent() -> None:
    """The options were a free dict on the wire; they are a typed struct now, reading the same keys (a
    snapshot's saved Run, or a Run published by hand, from before the change still decodes)."""
    body = msgspec.msgpack.encode(
        {
            "type": "Run",
            "v": SCHEMA_VERSION,
            "rollout_id": "t0001_g0",
            "attempt": 1,
            "group_id": "t0001",
            "env": "bank",
            "prompt": "p",
            "task": {
                "agent": "tool",
                "resources": 1,
                "max_tokens": 160,
                "continue_from": 3,
                "hold_at_turn": 2,
            },
        }
    )
    run = codec.decode(body, codec.MSGPACK)
    assert isinstance(run, m.Run)
    assert run.task == m.TaskOptions(resources=1, max_tokens=160, continue_from=3, hold_at_turn=2)
    assert codec.decode(codec.encode(run), codec.MSGPACK) == run


@pytest.mark.parametrize("task", [{"resources": "1"}, {"max_tokens": 0}, {"continue_from": -1}, {"typo": 1}])
def test_bad_task_options_are_refused_at_the_edge(task: dict[str, object]) -> None:
    body = msgspec.json.encode(
        {
            "type": "Run",
            "v": SCHEMA_VERSION,
            "rollout_id": "a_g0",
            "attempt": 0,
            "group_id": "a",
            "env": "e",
            "prompt": "p",
            "task": task,
        }
    )
    with pytest.raises(ProtocolError) as refused:
        codec.decode(body, codec.JSON)
    assert refused.value.code is ErrorCode.INVALID_MESSAGE
