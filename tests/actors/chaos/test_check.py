"""The history checker on hand-made histories, one per invariant it guards, and on real ones.

Each broken history breaks exactly one invariant; its test asserts that this check fails (for the
right reason, by its message) and that every other check still passes, so a check that fails for
everything, or for nothing, is caught too.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
from parkway.actors.chaos.check import CHECKS, RunHistory, Verdict, check, load_run, shortest_slice
from parkway.actors.runtime.history import (
    HISTORY_ENV,
    History,
    HistoryFormatError,
    Record,
    read_file,
    read_history,
)
from parkway.protocol.history import RowSealed, RowStaged, record_from_fields

from tests.support.embedded import embedded_run

ROLLOUTS = ("t0000_g0", "t0000_g1")


class Builder:
    """A history written by hand: each record one hundredth of a second after the last."""

    def __init__(self) -> None:
        self.t = 1_000.0
        self.records: list[Record] = []
        self.n: dict[tuple[str, str], int] = defaultdict(int)
        self.snapshots: dict[str, list[str]] = {}

    def add(
        self, actor: str, kind: str, inc: str = "1", *, at: float | None = None, **fields: object
    ) -> Record:
        """A record 0.01 s after the last one, or ``at`` that time (then kept in time order)."""
        if at is None:
            self.t += 0.01
        self.n[(actor, inc)] += 1
        pid = int(inc.split(".")[0])
        n = self.n[(actor, inc)]
        record = record_from_fields(kind, t=at or self.t, n=n, actor=actor, pid=pid, inc=inc, **fields)
        self.records.append(record)
        self.records.sort(key=lambda r: r.t)
        return record

    def turn(self, rollout: str, attempt: int, index: int, *, inc: str = "1", mutation: bool = True) -> None:
        """One model call and one tool call of a rollout, as every actor records them."""
        self.add("agent/0", "model_call", inc, r=rollout, a=attempt, i=index)
        self.add("policy/0", "generate", inc, r=rollout, a=attempt, i=index)
        self.add("policy/0", "generated", inc, r=rollout, a=attempt, i=index)
        ck = rollout if attempt == 0 else f"{rollout}-a{attempt}"
        self.add("tq/0", "staged", inc, ck=ck, i=index)
        self.add("agent/0", "model_reply", inc, r=rollout, a=attempt, i=index)
        if mutation:
            self.add(
                "agent/0", "tool_call", inc, r=rollout, a=attempt, i=index, tool="transfer", to="resources/0"
            )
            self.add(
                "resources/0",
                "mutation",
                inc,
                r=rollout,
                a=attempt,
                i=index,
                tool="transfer",
                rev=index + 1,
                effect={},
            )

    def finish(
        self, rollout: str, attempt: int, *, controller: str = "1", seq: int, applied: list[int]
    ) -> None:
        self.add(
            "resources/0",
            "verified",
            r=rollout,
            a=attempt,
            reward=1.0,
            rev=len(applied),
            applied=applied,
            recorded=len(applied),
        )
        self.add("agent/0", "receipt", r=rollout, a=attempt, of="completed")
        ck = rollout if attempt == 0 else f"{rollout}-a{attempt}"
        self.add("tq/0", "sealed", r=rollout, a=attempt, ck=ck, turns=[0, 1], replaced=None)
        self.add("controller/0", "seal", controller, r=rollout, a=attempt, ck=ck, reward=1.0, seq=seq)

    def publish(self, name: str, cid: str, *, controller: str = "1", seals: int) -> None:
        self.add("controller/0", "snap", controller, cid=cid, step="capture")
        self.add("controller/0", "captured", controller, cid=cid, seals=seals)
        self.add("controller/0", "published", controller, cid=cid, snapshot=name, episodes=[])
        self.add("controller/0", "snap_done", controller, cid=cid, snapshot=name)
        self.snapshots[name] = []

    def history(self, *, chaos: bool = False) -> RunHistory:
        return RunHistory(list(self.records), dict(self.snapshots), chaos)


def clean() -> Builder:
    """Two rollouts, two turns each, a snapshot in between, the run finished."""
    b = Builder()
    for actor in ("tq/0", "policy/0", "resources/0", "agent/0", "controller/0"):
        b.add(actor, "started", started_at=b.t)
    b.add("controller/0", "run_started", restored=False, epoch=1, expected=list(ROLLOUTS))
    for rollout in ROLLOUTS:
        b.add("controller/0", "dispatch", r=rollout, a=0, epoch=1, replica=0, continue_from=None)
        b.add("agent/0", "run", r=rollout, a=0, epoch=1, outcome="accepted")
        b.add("resources/0", "session_opened", r=rollout, a=0, i=0)
        b.turn(rollout, 0, 0)
    b.publish("snapshot_1", "ck-1", seals=0)
    for seq, rollout in enumerate(ROLLOUTS, start=1):
        b.turn(rollout, 0, 1)
        b.finish(rollout, 0, seq=seq, applied=[0, 1])
    b.add("controller/0", "run_finished", sealed=2, failed=0, expected=2, transcripts_sha256="x")
    return b


def failed_checks(verdict: Verdict) -> list[str]:
    return [c.name for c in verdict.checks if not c.ok]


def messages(verdict: Verdict, name: str) -> str:
    return "\n".join(v.message for c in verdict.checks if c.name == name for v in c.violations)


def test_a_clean_history_passes_every_check() -> None:
    verdict = check(clean().history())
    assert verdict.ok, verdict.report()
    assert [c.name for c in verdict.checks] == list(CHECKS)
    assert verdict.stats["seals"] == 2 and verdict.stats["controllers"] == 1


def test_a_run_that_never_finished_fails_run_completed() -> None:
    b = clean()
    b.records = [r for r in b.records if r.kind != "run_finished"]
    verdict = check(b.history())
    assert failed_checks(verdict) == ["run_completed"]
    assert "never finished the run" in messages(verdict, "run_completed")


def test_a_rollout_sealed_twice_fails_sealed_exactly_once() -> None:
    b = clean()
    b.add("controller/0", "dispatch", r="t0000_g0", a=1, epoch=1, replica=0, continue_from=None)
    b.add("controller/0", "seal", r="t0000_g0", a=1, ck="t0000_g0-a1", reward=1.0, seq=3)
    b.records.append(b.records.pop(-3))  # run_finished last again
    verdict = check(b.history())
    assert "sealed_exactly_once" in failed_checks(verdict)
    assert "t0000_g0 sealed 2 times" in messages(verdict, "sealed_exactly_once")


def test_a_rollout_never_sealed_fails_sealed_exactly_once() -> None:
    b = clean()
    b.records = [r for r in b.records if not (r.kind == "seal" and r.fields["r"] == "t0000_g1")]
    verdict = check(b.history())
    assert "sealed_exactly_once" in failed_checks(verdict)
    assert "t0000_g1 was never sealed" in messages(verdict, "sealed_exactly_once")


def crashed_after_snapshot(*, seal_again: str) -> Builder:
    """Controller 1 seals g0, publishes (1 seal captured), seals g1, dies; controller 2 restores the
    snapshot and seals ``seal_again`` (g1 is right: its first seal died with controller 1)."""
    b = Builder()
    b.add("controller/0", "run_started", "1", restored=False, epoch=1, expected=list(ROLLOUTS))
    for rollout in ROLLOUTS:
        b.add("controller/0", "dispatch", "1", r=rollout, a=0, epoch=1, replica=0, continue_from=None)
        b.add("resources/0", "session_opened", r=rollout, a=0, i=0)
        b.turn(rollout, 0, 0)
    b.finish("t0000_g0", 0, controller="1", seq=1, applied=[0])
    b.publish("snapshot_1", "ck-1", controller="1", seals=1)
    b.finish("t0000_g1", 0, controller="1", seq=2, applied=[0])  # lost with controller 1
    b.add("controller/0", "started", "2", started_at=b.t)
    b.add("controller/0", "restore_started", "2", rid="rs-1", snapshot="snapshot_1", saved_cid="ck-1")
    b.add("agent/0", "continuation", r="t0000_g1", a=1, saved_attempt=0, kept_model=1, kept_tools=1)
    b.add("resources/0", "session_restored", r="t0000_g1", a=1, saved_attempt=0, rev=1, applied=[0])
    b.add(
        "controller/0",
        "fenced",
        "2",
        rid="rs-1",
        snapshot="snapshot_1",
        saved_cid="ck-1",
        epoch=2,
        attempts=[["t0000_g1", 0]],
        continued=[["t0000_g1", 1, 0]],
    )
    b.add("controller/0", "run_started", "2", restored=True, epoch=2, expected=list(ROLLOUTS))
    b.add("controller/0", "dispatch", "2", r="t0000_g1", a=1, epoch=2, replica=0, continue_from=0)
    b.add("agent/0", "model_replayed", r="t0000_g1", a=1, i=0)
    b.turn("t0000_g1", 1, 1)
    attempt = 1 if seal_again == "t0000_g1" else 0
    b.finish(seal_again, attempt, controller="2", seq=1, applied=[0, 1])
    b.add("controller/0", "run_finished", "2", sealed=2, failed=0, expected=2, transcripts_sha256="x")
    return b


def test_seals_lost_with_a_crashed_controller_do_not_count() -> None:
    verdict = check(crashed_after_snapshot(seal_again="t0000_g1").history())
    assert verdict.ok, verdict.report()
    sealed = next(c for c in verdict.checks if c.name == "sealed_exactly_once")
    assert "controller 2: 1 seals, restored ck-1; controller 1: 1 seals" in sealed.detail


def test_a_restored_controller_sealing_a_captured_rollout_again_fails() -> None:
    verdict = check(crashed_after_snapshot(seal_again="t0000_g0").history())
    assert "sealed_exactly_once" in failed_checks(verdict)
    text = messages(verdict, "sealed_exactly_once")
    assert "t0000_g0 sealed 2 times" in text and "t0000_g1 was never sealed" in text


def test_tq_replacing_a_canonical_row_fails_sealed_exactly_once() -> None:
    b = clean()
    b.add("tq/0", "sealed", r="t0000_g0", a=1, ck="t0000_g0-a1", turns=[0], replaced="t0000_g0")
    verdict = check(b.history())
    assert failed_checks(verdict) == ["sealed_exactly_once"]
    assert "replaced the canonical row of t0000_g0 (t0000_g0 -> t0000_g0-a1)" in messages(
        verdict, "sealed_exactly_once"
    )


def test_a_saved_turn_generated_again_after_a_restore_fails_no_turn_regenerated() -> None:
    b = crashed_after_snapshot(seal_again="t0000_g1")
    dispatch = next(r for r in b.records if r.kind == "dispatch" and r.inc == "2")
    b.t = dispatch.t + 0.001
    b.add("policy/0", "generate", r="t0000_g1", a=1, i=0)  # kept_model=1: call 0 was saved
    verdict = check(b.history())
    assert failed_checks(verdict) == ["no_turn_regenerated"]
    assert "continued from 1 saved model calls, yet policy/0 generated call 0 again" in messages(
        verdict, "no_turn_regenerated"
    )


def test_the_call_in_flight_at_the_snapshot_may_be_generated_again() -> None:
    b = crashed_after_snapshot(seal_again="t0000_g1")
    # Attempt 0 had generated call 1 before the crash (in flight, not in the snapshot): attempt 1 redoes it.
    b.records.insert(
        10,
        record_from_fields(
            "generated",
            t=b.records[9].t + 0.0001,
            n=99,
            actor="policy/0",
            pid=1,
            inc="1",
            r="t0000_g1",
            a=0,
            i=1,
        ),
    )
    assert check(b.history()).ok


def test_a_mutation_applied_twice_in_one_session_fails_mutations_exactly_once() -> None:
    b = clean()
    first = next(r for r in b.records if r.kind == "mutation" and r.fields["r"] == "t0000_g0")
    b.t = first.t + 0.001
    b.add("resources/0", "mutation", r="t0000_g0", a=0, i=0, tool="transfer", rev=2, effect={})
    verdict = check(b.history())
    assert failed_checks(verdict) == ["mutations_exactly_once"]
    assert "tool call 0 (transfer) applied twice in one session" in messages(
        verdict, "mutations_exactly_once"
    )


def test_a_session_that_lost_a_mutation_fails_mutations_exactly_once() -> None:
    b = clean()
    for index, record in enumerate(b.records):
        if record.kind == "verified" and record.fields["r"] == "t0000_g1":
            # a fresh session after a crash
            b.records[index] = msgspec.structs.replace(record, applied=(1,), revision=1, reward=0.0)
    verdict = check(b.history())
    assert failed_checks(verdict) == ["mutations_exactly_once"]
    assert (
        "t0000_g1 attempt 0: its agent recorded 2 mutations, the session applied 1 (calls [1]) at revision 1, "
        "reward 0.0: mutations lost" in messages(verdict, "mutations_exactly_once")
    )


def test_a_mutation_of_a_restored_session_applied_again_fails() -> None:
    b = crashed_after_snapshot(seal_again="t0000_g1")
    restored = next(r for r in b.records if r.kind == "session_restored")
    b.t = restored.t + 0.0001
    b.add(
        "resources/0", "mutation", r="t0000_g1", a=1, i=0, tool="transfer", rev=2, effect={}
    )  # call 0 was applied
    verdict = check(b.history())
    assert "mutations_exactly_once" in failed_checks(verdict)
    assert "t0000_g1 attempt 1: tool call 0 (transfer) applied twice" in messages(
        verdict, "mutations_exactly_once"
    )


def test_a_fenced_attempt_accepted_after_the_restore_fails_fenced_attempts_stay_fenced() -> None:
    b = crashed_after_snapshot(seal_again="t0000_g1")
    fenced = next(r for r in b.records if r.kind == "fenced")
    b.t = fenced.t + 0.0001
    b.add("policy/0", "generate", r="t0000_g1", a=0, i=1)  # attempt 0 is fenced: the policy must refuse it
    verdict = check(b.history())
    assert failed_checks(verdict) == ["fenced_attempts_stay_fenced"]
    assert "policy/0 accepted generate of t0000_g1 attempt 0" in messages(
        verdict, "fenced_attempts_stay_fenced"
    )


def test_an_attempt_number_the_dead_controller_used_is_the_restored_ledgers_again() -> None:
    # Found by parkway chaos: the dead controller had dispatched attempt 1 of t0000_g1 after the
    # snapshot; the restore rolled the ledger back and gave attempt 1 to the rollout's continuation.
    # That attempt is not superseded: the dead timeline's dispatches after the capture no longer exist.
    b = crashed_after_snapshot(seal_again="t0000_g1")
    lost = next(r for r in b.records if r.kind == "seal" and r.inc == "1" and r.fields["r"] == "t0000_g1")
    t = lost.t  # after the capture, before the controller died (0.01 s later)
    b.add(
        "controller/0",
        "dispatch",
        "1",
        at=t + 0.001,
        r="t0000_g1",
        a=1,
        epoch=1,
        replica=0,
        continue_from=None,
    )
    b.add(
        "controller/0",
        "dispatch",
        "1",
        at=t + 0.002,
        r="t0000_g1",
        a=2,
        epoch=1,
        replica=0,
        continue_from=None,
    )
    b.add("agent/0", "run", at=t + 0.003, r="t0000_g1", a=2, epoch=1, outcome="accepted")
    verdict = check(b.history())
    assert verdict.ok, verdict.report()
    fenced = next(c for c in verdict.checks if c.name == "fenced_attempts_stay_fenced")
    assert fenced.detail.endswith("1 restores rolled the timeline back")
    # ... while in the dead timeline itself, attempt 0 accepted after attempt 1 existed is still caught.
    b.add("policy/0", "generate", at=t + 0.004, r="t0000_g1", a=0, i=5)
    verdict = check(b.history())
    assert failed_checks(verdict) == ["fenced_attempts_stay_fenced"]
    assert "policy/0 accepted generate of t0000_g1 attempt 0" in messages(
        verdict, "fenced_attempts_stay_fenced"
    )


def test_an_old_attempt_sealed_after_a_new_one_was_dispatched_fails() -> None:
    b = clean()
    seal = next(r for r in b.records if r.kind == "seal" and r.fields["r"] == "t0000_g1")
    b.t = seal.t - 0.015  # the next record comes 0.01 later: before the seal
    b.add("controller/0", "dispatch", r="t0000_g1", a=1, epoch=1, replica=0, continue_from=None)
    verdict = check(b.history())
    assert "fenced_attempts_stay_fenced" in failed_checks(verdict)
    assert "controller/0 accepted seal of t0000_g1 attempt 0" in messages(
        verdict, "fenced_attempts_stay_fenced"
    )


def test_a_published_snapshot_that_does_not_verify_fails_snapshots_verify() -> None:
    b = clean()
    b.snapshots["snapshot_1"] = ["snapshot_1: ledger.msgpack has another sha256 than listed"]
    verdict = check(b.history())
    assert failed_checks(verdict) == ["snapshots_verify"]
    assert (
        "published snapshot snapshot_1 does not verify: snapshot_1: ledger.msgpack has another sha256"
        in messages(verdict, "snapshots_verify")
    )


def test_a_published_snapshot_gone_from_disk_fails_snapshots_verify() -> None:
    b = clean()
    del b.snapshots["snapshot_1"]
    verdict = check(b.history())
    assert failed_checks(verdict) == ["snapshots_verify"]
    assert "published snapshot snapshot_1 is not on disk" in messages(verdict, "snapshots_verify")


def test_a_restore_of_a_snapshot_nobody_published_fails_snapshots_verify() -> None:
    b = crashed_after_snapshot(seal_again="t0000_g1")
    b.records = [r for r in b.records if r.kind != "published"]
    verdict = check(b.history())
    assert "snapshots_verify" in failed_checks(verdict)
    assert "restored snapshot_1 (ck-1), which no controller published" in messages(
        verdict, "snapshots_verify"
    )


def test_a_history_without_work_fails_progress() -> None:
    b = Builder()
    b.add("controller/0", "run_started", restored=False, epoch=1, expected=[])
    b.add("controller/0", "run_finished", sealed=0, failed=0, expected=0, transcripts_sha256="x")
    verdict = check(b.history())
    assert failed_checks(verdict) == ["progress"]
    assert "no rollout was sealed" in messages(verdict, "progress")
    assert "no model call was generated" in messages(verdict, "progress")


def test_a_chaos_run_needs_faults_and_work_after_each() -> None:
    assert "a chaos run injected no fault" in messages(check(clean().history(chaos=True)), "progress")
    b = clean()
    b.add("nemesis/0", "fault", fault="kill_actor", target="tq/0", step="between snapshots", detail="")
    verdict = check(b.history(chaos=True))
    assert failed_checks(verdict) == ["progress"]
    assert "nothing was done after the fault kill_actor on tq/0" in messages(verdict, "progress")
    b = clean()
    fault = record_from_fields(
        "fault",
        t=b.records[20].t + 0.0001,
        n=1,
        actor="nemesis/0",
        pid=9,
        inc="9",
        fault="kill_actor",
        target="tq/0",
        step="between snapshots",
        detail="",
    )
    b.records.insert(21, fault)
    assert check(b.history(chaos=True)).ok


def test_the_report_shows_the_shortest_slice_of_the_offending_rollout() -> None:
    b = clean()
    b.add("controller/0", "seal", r="t0000_g0", a=0, ck="t0000_g0", reward=1.0, seq=3)
    b.add("controller/0", "run_finished", sealed=2, failed=0, expected=2, transcripts_sha256="x")
    verdict = check(b.history())
    violation = next(v for v in verdict.violations if v.check == "sealed_exactly_once")
    lines = shortest_slice(verdict.records, violation)
    assert [r for r, marked in lines if marked] == violation.evidence
    assert all(r.fields.get("r") in (None, "t0000_g0") for r, _ in lines)  # nothing of the other rollout
    assert {"dispatch", "model_call", "mutation", "seal"} <= {r.kind for r, _ in lines}
    report = verdict.report()
    assert report.startswith("history check: FAIL")
    assert "sealed_exactly_once: t0000_g0 sealed 2 times" in report
    assert "> " in report and "r=t0000_g1" not in report.split("sealed_exactly_once: t0000_g0")[1]


# -- the files ---------------------------------------------------------------------------------
def test_history_is_off_unless_asked_for(tmp_path: Path) -> None:
    off = History.from_env("run1", "tq/0", {"PARKWAY_STATE_DIR": str(tmp_path)})
    off.record(RowStaged(capture_key="x", turn=0))
    assert not off.enabled and not (tmp_path / "history").exists()
    on = History.from_env("run1", "tq/0", {"PARKWAY_STATE_DIR": str(tmp_path), HISTORY_ENV: "1"})
    on.record(RowStaged(capture_key="x", turn=0))
    # A record built from its file-named fields is the same typed record...
    on.record(record_from_fields("sealed", r="x", a=0, ck="x", turns=[0], replaced=None))
    # ... and one with a field its kind does not have, even one named like the kind argument, is refused.
    with pytest.raises(HistoryFormatError, match="a sealed record has no field kind"):
        record_from_fields("sealed", r="x", a=0, kind="a field named like the kind")
    on.close()
    [path] = (tmp_path / "history" / "run1").glob("tq-0-*.jsonl")
    first, second = read_file(path)
    assert (first.kind, first.n, first.actor, first.fields) == ("staged", 1, "tq/0", {"ck": "x", "i": 0})
    assert isinstance(second, RowSealed) and (second.rollout_id, second.turns, second.replaced) == (
        "x",
        (0,),
        None,
    )


def test_a_line_cut_by_a_kill_is_skipped_and_any_other_bad_line_is_named(tmp_path: Path) -> None:
    good = json.dumps(
        {"t": 1.0, "n": 1, "k": "staged", "actor": "tq/0", "pid": 5, "inc": "5", "ck": "x", "i": 0}
    )
    (tmp_path / "a.jsonl").write_text(good + "\n" + good[:20])
    assert [r.kind for r in read_history(tmp_path)] == ["staged"]
    (tmp_path / "a.jsonl").write_text(good[:20] + "\n" + good + "\n")
    with pytest.raises(HistoryFormatError, match=r"a\.jsonl:1: not JSON"):
        read_history(tmp_path)
    (tmp_path / "a.jsonl").write_text(json.dumps({"t": 1.0, "k": "x"}) + "\n")
    with pytest.raises(
        HistoryFormatError, match=r"a\.jsonl:1: a record needs the fields t, n, k, actor, pid, inc"
    ):
        read_history(tmp_path)


def test_loading_a_run_without_history_says_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="PARKWAY_HISTORY=1"):
        load_run(tmp_path, "nothing")


# -- real histories ------------------------------------------------------------------------------
REAL = {
    "run": "hist",
    "seed": 21,
    "rollout": {"group_size": 3, "max_turns": 6},
    "tasks": {"builtin": "bank", "limit": 2},
    "policy": {"host": "inline", "per_token_delay_s": 0.002},
    "trainer": {"batch_groups": 1},
    "snapshot_interval_s": 0.2,
    "keep_latest_k": 1000,
}


async def test_a_real_clean_run_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HISTORY_ENV, "1")
    monkeypatch.setenv("PARKWAY_STATE_DIR", str(tmp_path))
    summary = await embedded_run(REAL, tmp_path)
    verdict = check(load_run(tmp_path, "hist"))
    assert verdict.ok, verdict.report()
    assert verdict.stats["seals"] == summary.rollouts_sealed == 6
    assert summary.snapshots_published >= 1
    published = next(c for c in verdict.checks if c.name == "snapshots_verify")
    assert (
        f"{summary.snapshots_published} published, {summary.snapshots_published} on disk checked"
        in published.detail
    )


async def test_a_real_crash_and_restore_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from parkway.actors.roles.controller.controller import SimulatedCrash

    monkeypatch.setenv(HISTORY_ENV, "1")
    monkeypatch.setenv("PARKWAY_STATE_DIR", str(tmp_path))
    with pytest.raises(SimulatedCrash):
        await embedded_run(REAL, tmp_path, stop_after=2)
    summary = await embedded_run(REAL, tmp_path)
    assert summary.restores == 1 and summary.rollouts_restored > 0
    verdict = check(load_run(tmp_path, "hist"))
    assert verdict.ok, verdict.report()
    assert verdict.stats["controllers"] == 2 and verdict.stats["restores"] == 1
    continued = next(c for c in verdict.checks if c.name == "no_turn_regenerated")
    assert continued.detail.startswith(f"{summary.rollouts_restored} rollouts continued after a restore")
