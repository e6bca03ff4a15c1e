"""The on-disk formats as types: what they write is what the dict-based writers wrote, and what older
snapshots hold still reads."""

from __future__ import annotations

import json

import msgspec
import pytest
from parkway.protocol import layout
from parkway.protocol.anchor import (
    ControllerAnchor,
    LedgerFile,
    decode_anchor,
    decode_ledger_file,
    encode_anchor,
    encode_ledger_file,
    transcripts_hex,
)
from parkway.protocol.manifest import (
    SCHEMA,
    Manifest,
    ManifestFile,
    TrainerMark,
    decode_manifest,
    encode_manifest,
)

SHA = "ab" * 32

ANCHOR = {
    "policy_version": 3,
    "epoch": 2,
    "train_steps": 3,
    "next_task": 7,
    "first_in_play": 5,
    "sealed": 15,
    "reward_sum": 14.5,
    "transcripts": f"{12345:064x}",
    "trained_groups": ["t0005"],
    "counts": {"rollouts_sealed": 15, "attempts_dispatched": 21},
}


def test_a_ledger_file_is_written_byte_for_byte_as_the_dict_was() -> None:
    typed = LedgerFile(ledger=b"\x81\xa1x\x01", controller=ControllerAnchor(**ANCHOR))  # type: ignore[arg-type]
    old = msgspec.msgpack.encode({"ledger": b"\x81\xa1x\x01", "controller": ANCHOR})
    # The anchor now also says which batch was in training at the cut (none here) and the session tag
    # of the run's ids (0: none); an anchor written before those fields decodes to the same value.
    now = {**ANCHOR, "training": None, "session": 0}
    assert encode_ledger_file(typed) == msgspec.msgpack.encode(
        {"ledger": b"\x81\xa1x\x01", "controller": now}
    )
    assert decode_ledger_file(old) == typed
    assert encode_anchor(typed.controller) == msgspec.msgpack.encode(now)
    assert decode_anchor(msgspec.msgpack.encode(ANCHOR)) == typed.controller
    assert typed.controller.transcripts_sum == 12345


def test_an_anchor_from_before_the_sums_and_the_cursor_still_reads() -> None:
    # Snapshots written before the sums list every trained rollout and its reward, and have no task
    # cursor: every task was admitted at the start, so all of them are in that ledger.
    old = {
        "policy_version": 2,
        "epoch": 1,
        "train_steps": 2,
        "sealed_rows": {"t0000_g0": 1.0, "t0000_g1": 0.5, "t0001_g0": 1.0},
        "sealed_digests": {"t0000_g0": "00", "t0000_g1": "00", "t0001_g0": "00"},
        "counts": {"rollouts_sealed": 3},
    }
    anchor = decode_ledger_file(msgspec.msgpack.encode({"ledger": b"", "controller": old})).controller
    assert (anchor.sealed, anchor.reward_sum, anchor.transcripts_sum) == (3, 2.5, 0)
    assert anchor.next_task is None and anchor.first_in_play == 0 and anchor.trained_groups == []
    assert (anchor.policy_version, anchor.epoch, anchor.train_steps) == (2, 1, 2)
    assert anchor.counts == {"rollouts_sealed": 3}
    assert transcripts_hex(2**256 + 5) == f"{5:064x}"


def test_a_malformed_ledger_file_is_a_decode_error() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_ledger_file(msgspec.msgpack.encode({"ledger": b""}))
    with pytest.raises(msgspec.DecodeError):
        decode_ledger_file(b"\xc1")


def manifest() -> Manifest:
    return Manifest(
        schema=SCHEMA,
        checkpoint_id="ck-20240101T000000.000-abcdef",
        seq=2,
        run="snaps",
        created_at=1700000000.123456,
        trainer=TrainerMark(step=1, policy_version=1),
        config_fingerprint=SHA,
        topology_fingerprint=SHA,
        episodes=[("t0000_g0", 0), ("t0001_g2", 1)],
        restarts=[],
        files=[
            ManifestFile(
                path="participants/agent/0/rollouts.msgpack",
                sha256=SHA,
                size=10,
                records=2,
                checkpoint_id="ck-20240101T000000.000-abcdef",
            )
        ],
    )


def test_the_manifest_is_written_as_the_dict_was() -> None:
    typed = manifest()
    as_dict = json.loads(json.dumps(msgspec.to_builtins(typed)))
    assert encode_manifest(typed) == json.dumps(as_dict, indent=1, sort_keys=True)
    assert decode_manifest(encode_manifest(typed)) == typed
    assert decode_manifest(json.dumps(as_dict, indent=1, sort_keys=True).encode()) == typed


def test_a_manifest_that_does_not_fit_its_schema_is_refused() -> None:
    bad_digest = json.loads(encode_manifest(manifest()))
    bad_digest["files"][0]["sha256"] = "not a digest"
    with pytest.raises(msgspec.ValidationError, match=r"\$\.files\[0\]\.sha256"):
        decode_manifest(json.dumps(bad_digest))
    no_trainer = json.loads(encode_manifest(manifest()))
    del no_trainer["trainer"]
    with pytest.raises(msgspec.ValidationError, match="missing required field `trainer`"):
        decode_manifest(json.dumps(no_trainer))


def test_the_layout_names_and_their_parsers_agree() -> None:
    assert layout.snapshot_dir_name(12) == "snapshot_12"
    assert layout.parse_snapshot_dir_name("snapshot_12") == 12
    for other in ("snapshot_", "snapshot_x", "snapshot_-1", "snapshot_²", "tmp_ck-1", "12"):
        assert layout.parse_snapshot_dir_name(other) is None
    assert layout.tmp_dir_name("ck-1") == "tmp_ck-1"
    for name in (layout.snapshot_dir_name(3), layout.tmp_dir_name("ck-20240101T000000.000-abcdef")):
        assert layout.LOCATION_PATTERN.fullmatch(name)
    assert not layout.LOCATION_PATTERN.fullmatch("../snapshot_1")
    assert layout.participant_parts("agent", 1) == ("participants", "agent", "1")
    assert layout.participant_parts("tq", 0) == ("tq",)
    assert (
        str(layout.participant_dir("resources", 0) / "sessions.msgpack")
        == "participants/resources/0/sessions.msgpack"
    )
    assert layout.writer_of("participants/agent/1/rollouts.msgpack") == "agent/1"
    assert layout.writer_of("tq/staging.msgpack") == "tq/0"
    assert layout.writer_of(layout.LEDGER) == "controller/0"
    assert layout.fallback_file_name(4) == "fallback_4.msgpack"
    assert layout.trainer_state_file_name(4) == "step_4.msgpack"
    assert layout.parse_trainer_state_file_name("step_4.msgpack") == 4
    for other in ("step_4.tmp", "fallback_4.msgpack", "step_.msgpack", "step_x.msgpack"):
        assert layout.parse_trainer_state_file_name(other) is None


def test_an_anchor_keeps_the_batch_in_training_at_the_cut() -> None:
    from parkway.protocol.training import InTraining

    anchor = ControllerAnchor(**ANCHOR, training=InTraining(step=4, groups=("t0005", "t0006")))  # type: ignore[arg-type]
    decoded = decode_ledger_file(encode_ledger_file(LedgerFile(ledger=b"", controller=anchor))).controller
    assert decoded.training == InTraining(step=4, groups=("t0005", "t0006"))
    assert decode_anchor(encode_anchor(anchor)) == anchor
