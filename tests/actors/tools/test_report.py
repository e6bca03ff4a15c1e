"""``parkway report``: the timeline of a real run that crashed and restored, drawn as PNG and HTML.

The log comes from a real workload on the in-memory broker, written by ``configure_logging`` exactly as
``parkway run --log-level info 2> run.log`` writes it: the run dies right after its second snapshot
(``SimulatedCrash``), a fresh cluster restores that snapshot and finishes. What the report says is checked
against what the run itself reports: the trainer's canonical rows, the run summary, the manifest.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog
from parkway.actors.builtin.trainers import ExampleTrainer
from parkway.actors.launch.processes import clean_environment
from parkway.actors.roles.controller.controller import SimulatedCrash
from parkway.actors.runtime.logs import configure_logging
from parkway.actors.sdk.trainer import GroupResult, TrainStep
from parkway.actors.tools import cli, report
from parkway.protocol.messages import CanonicalRow

from tests.support.embedded import embedded_run

RUN = "rpt"
CONFIG = {
    "run": RUN,
    "seed": 3,
    "policy": {"host": "inline", "per_token_delay_s": 0.002},  # turns long enough that the crash cuts some
    "tasks": {"builtin": "bank", "limit": 3},
    "rollout": {"group_size": 3, "max_turns": 6},
    "recovery": {"target_level": "turn"},
    "faults": {"fail_attempts": ["t0002_g1@0:1"]},  # one attempt fails on its own and is redone
    "snapshot_interval_s": 0.05,
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class RecordingTrainer(ExampleTrainer):
    """The example trainer, keeping every canonical row it is handed (what the run really produced)."""

    rows: dict[str, CanonicalRow] = field(default_factory=dict)

    def train(self, batch: list[GroupResult]) -> TrainStep:
        for group in batch:
            for row in group.rows:
                self.rows[row.rollout_id] = row
        return super().train(batch)


async def _workload(state: Path, trainer: RecordingTrainer, stop_after: int | None = None):
    return await embedded_run(CONFIG, state, stop_after=stop_after, trainer=trainer)


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One real run that crashes after its second snapshot and restores it, logged at info to a file."""
    tmp = tmp_path_factory.mktemp("report")
    state, log_path = tmp / "state", tmp / "run.log"
    before, after = RecordingTrainer(), RecordingTrainer()
    saved = structlog.get_config()
    with open(log_path, "w") as stream:
        configure_logging(stream=stream, level="info")
        try:
            with pytest.raises(SimulatedCrash):
                asyncio.run(_workload(state, before, stop_after=2))
            [newest] = sorted((state / "snapshots" / RUN).glob("snapshot_*"))[-1:]
            manifest = json.loads((newest / "manifest.json").read_text())
            summary = asyncio.run(_workload(state, after))
        finally:
            structlog.configure(**saved)
    rows = {**before.rows, **after.rows}  # a group trained twice (after the snapshot): the second counts
    return SimpleNamespace(log=log_path, manifest=manifest, snapshot=newest.name, summary=summary, rows=rows)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_the_timeline_holds_every_rollout_and_turn(crashed_run) -> None:
    timeline = report.build_timeline(_lines(crashed_run.log), RUN)
    summary = crashed_run.summary
    assert summary.restores == 1 and summary.rollouts_sealed == 9
    # Every rollout, each ending in the attempt that was sealed, with as many turns as its canonical row.
    assert set(timeline.rollouts) == set(crashed_run.rows) and len(timeline.rollouts) == 9
    for rollout_id, row in crashed_run.rows.items():
        rollout = timeline.rollouts[rollout_id]
        assert rollout.sealed_attempt == row.attempt, rollout_id
        assert rollout.turns == len(row.turns) == rollout.sealed_turns, rollout_id
        assert rollout.group_id == rollout_id.rpartition("_g")[0]
    # The rollouts the restore continued start their new attempt from the snapshot's turns.
    continuing = [a for a in timeline.attempts() if a.continuing]
    assert len(continuing) == summary.rollouts_restored > 0
    assert sum(a.kept_turns for a in continuing) == sum(1 for a in continuing for t in a.turns if t.replayed)
    # The injected failure: attempt 0 of t0002_g1 failed, a later attempt was sealed.
    failed = timeline.rollouts["t0002_g1"].attempts[0]
    assert failed.outcome == "failed" and failed.code == "injected"
    # Snapshot pauses by checkpoint id, the one restored among them.
    assert timeline.pauses and all(p.end is not None and p.end >= p.start for p in timeline.pauses)
    restored_id = crashed_run.manifest["checkpoint_id"]
    [pause] = [p for p in timeline.pauses if p.checkpoint_id == restored_id]
    assert pause.snapshot == crashed_run.snapshot and pause.outcome == "published"
    # One crash (the controller said why), one restore of that snapshot, two controller incarnations.
    [crash] = timeline.crashes
    assert not crash.inferred and "SimulatedCrash" in crash.detail
    [restore] = timeline.restores
    assert restore.outcome == "done" and restore.saved_checkpoint == restored_id
    assert restore.snapshot == crashed_run.snapshot and restore.continued == summary.rollouts_restored
    assert crash.ts <= restore.start <= restore.end
    # After the restore, a turn generated is a model call the policy served: its own counter agrees.
    generated = [
        t for a in timeline.attempts() for t in a.turns if not t.replayed and t.start >= restore.start
    ]
    assert len(generated) == summary.model_calls
    assert timeline.incarnations == 2 and timeline.finished
    # Every turn is an interval; the ones in flight at the crash never finished, and none after the
    # restore began. (Rollouts run on while a snapshot is written, so a turn may start in the instant
    # between the controller's run_aborted line and the embedded cluster's teardown: it is cut too.)
    for attempt in timeline.attempts():
        for turn in (*attempt.superseded, *attempt.turns):
            assert turn.end is not None and turn.start <= turn.end
            if turn.cut and attempt.outcome != "failed":
                assert turn.start <= restore.start
    assert any(t.cut for a in timeline.attempts() for t in (*a.superseded, *a.turns))
    assert timeline.lines.malformed == 0 and timeline.lines.other_runs == 0
    s = timeline.summary()
    assert s["rollouts"] == s["rollouts_sealed"] == 9 and s["crashes"] == 1 and s["restores"] == 1
    # The whole cluster came back: six participants, the trainer (inline) and the controller.
    assert s["process_restarts"] == 8


def test_png_and_html(crashed_run, tmp_path: Path) -> None:
    timeline = report.build_timeline(_lines(crashed_run.log), RUN)
    png, page = report.write_report(timeline, tmp_path / "out")
    assert png == tmp_path / "out" / f"{RUN}.png" and page == tmp_path / "out" / f"{RUN}.html"
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    text = page.read_text()
    assert RUN in text
    for pause in timeline.pauses:
        assert pause.checkpoint_id in text
    assert crashed_run.manifest["checkpoint_id"] in text and "SimulatedCrash" in text
    assert "<svg" in text and "<title>t0000_g0 attempt 0 turn 0:" in text  # hover titles on the bars
    assert "src=" not in text and "<link" not in text and "<script" not in text  # nothing to fetch


def test_lines_that_do_not_belong_are_skipped_and_counted(crashed_run) -> None:
    lines = _lines(crashed_run.log)
    clean = report.build_timeline(lines, RUN).summary()
    ours = [line for line in lines if f'"run":"{RUN}"' in line]
    foreign = [line.replace(f'"run":"{RUN}"', '"run":"other"') for line in ours[:50]]
    garbage = ["not json", "{}", '{"event":"turn_started"}', "[1, 2]", '{"ts": "yesterday", "event": "x"}']
    truncated = lines[10][: len(lines[10]) // 2]  # a line cut off mid-write
    mixed = [*garbage[:2], *ours[:100], truncated, *foreign, *lines, *garbage[2:]]
    timeline = report.build_timeline(mixed, RUN)
    summary = timeline.summary()
    counts = summary.pop("lines")
    assert summary == {k: v for k, v in clean.items() if k != "lines"}
    assert counts["malformed"] == len(garbage) + 1
    assert counts["other_runs"] == len(foreign) and counts["duplicates"] == 100


def test_a_log_that_stops_mid_run(crashed_run) -> None:
    # The log of the first cluster only, up to its last turn: what a SIGKILL leaves (no run_aborted).
    lines = _lines(crashed_run.log)
    aborted = next(i for i, line in enumerate(lines) if '"run_aborted"' in line)
    last_turn = max(i for i, line in enumerate(lines[:aborted]) if '"turn_started"' in line)
    timeline = report.build_timeline(lines[: last_turn + 1], RUN)
    assert not timeline.finished and not timeline.crashes  # nothing says it died: it may still be running
    assert len(timeline.rollouts) == 9
    for attempt in timeline.attempts():
        assert attempt.ended is not None and attempt.ended <= timeline.end
        assert all(t.end is not None for t in attempt.turns)
    assert any(t.cut and t.end == timeline.end for a in timeline.attempts() for t in a.turns)
    assert all(p.end is not None for p in timeline.pauses)


def test_a_crash_without_a_last_word_is_inferred(crashed_run) -> None:
    # Drop what the dying controller and its cluster said after the crash: a SIGKILL says nothing.
    lines = _lines(crashed_run.log)
    aborted = next(i for i, line in enumerate(lines) if '"run_aborted"' in line)
    restart = next(
        i for i, line in enumerate(lines) if i > aborted and '"actor_started"' in line and '"tq/0"' in line
    )
    timeline = report.build_timeline(lines[:aborted] + lines[restart:], RUN)
    [crash] = timeline.crashes
    assert crash.inferred
    records = [json.loads(line) for line in lines[:aborted]]
    last_controller_line = next(r for r in reversed(records) if r.get("actor") == "controller/0")
    assert crash.ts == datetime.fromisoformat(last_controller_line["ts"]).timestamp()
    assert len(timeline.restores) == 1 and timeline.finished
    for rollout_id, row in crashed_run.rows.items():
        assert timeline.rollouts[rollout_id].turns == len(row.turns)


def test_a_run_started_again_after_it_finished_is_drawn_from_its_new_start(crashed_run) -> None:
    lines = _lines(crashed_run.log)
    once = report.build_timeline(lines, RUN).summary()

    def later(line: str) -> str:  # the same run again, an hour later
        record = json.loads(line)
        moment = datetime.fromisoformat(record["ts"]) + timedelta(hours=1)
        record["ts"] = moment.isoformat().replace("+00:00", "Z")
        return json.dumps(record)

    timeline = report.build_timeline(lines + [later(line) for line in lines], RUN)
    twice = timeline.summary()
    assert twice["lines"]["earlier_sessions"] > 0
    assert {k: v for k, v in twice.items() if k != "lines"} == {k: v for k, v in once.items() if k != "lines"}


def test_hundreds_of_rollouts_are_capped_and_say_so(crashed_run) -> None:
    timeline = report.build_timeline(_lines(crashed_run.log), RUN)
    drawing = report.draw(timeline, max_rows=4)
    assert drawing.hidden_rows == 5
    ax = drawing.figure.axes[0]  # the rollouts (the panel below them: reward and loss per step)
    assert len(drawing.figure.axes) == 1 + bool(timeline.training)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 4 and "t0002_g1" in labels  # the rollout with two attempts is drawn first
    assert "5 of 9 rollouts not drawn" in ax.get_title(loc="left")


@pytest.mark.slow  # `parkway report` as a process
def test_the_command_on_a_log_file(crashed_run, tmp_path: Path) -> None:
    env = clean_environment()
    args = ["report", RUN, "--logs", str(crashed_run.log), "--out", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "parkway.actors", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["run"] == RUN and summary["rollouts"] == 9 and summary["crashes"] == 1
    assert Path(summary["png"]).read_bytes().startswith(PNG_MAGIC) and Path(summary["html"]).is_file()
    other = subprocess.run(
        [sys.executable, "-m", "parkway.actors", "report", "nosuchrun", "--logs", str(crashed_run.log)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 1 and "no log line of run 'nosuchrun'" in other.stderr


def test_without_matplotlib_the_error_names_the_extra(
    crashed_run, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code = cli.main(["report", RUN, "--logs", str(crashed_run.log), "--out", str(tmp_path)])
    assert code == 2
    assert "pip install 'parkway[report]'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_reward_and_loss_per_train_step(crashed_run, tmp_path: Path) -> None:
    lines = _lines(crashed_run.log)
    trained = [
        json.loads(line) for line in lines if '"event": "trained"' in line or '"event":"trained"' in line
    ]
    assert trained, "the run trained"
    timeline = report.build_timeline(lines, RUN)
    assert [p.step for p in timeline.training] == sorted({r["step"] for r in trained})
    assert all(p.mean_reward is not None and p.loss is None for p in timeline.training)  # no loss logged
    # A trainer's own line carries the loss; a step trained again after a crash keeps its newest values.
    last = trained[-1]
    losses = [
        json.dumps({**last, "event": "grpo_step", "loss": 0.5, "ts": last["ts"]}),
        json.dumps({**last, "event": "grpo_step", "loss": 0.25, "mean_reward": 0.75, "ts": last["ts"]}),
    ]
    with_loss = report.build_timeline(lines + losses, RUN)
    point = with_loss.training[-1]
    assert (point.step, point.loss, point.mean_reward) == (last["step"], 0.25, 0.75)
    assert with_loss.summary()["train_steps"] == len(timeline.training)
    png, _ = report.write_report(with_loss, tmp_path / "out")
    assert png.read_bytes().startswith(PNG_MAGIC)  # the figure with its training panel


def test_an_attempt_started_again_after_a_restore_counts_only_its_new_life() -> None:
    # A restore that finds an attempt dispatched but holding none of its turns starts it again under
    # the same number: the turn its first life was cut in is superseded, not one of its turns.
    def line(second: int, event: str, actor: str = "agent/0", **fields: object) -> str:
        ts = datetime(2026, 1, 1, 0, 0, second).isoformat() + "Z"
        return json.dumps({"ts": ts, "event": event, "run": RUN, "actor": actor, **fields})

    ids = {"rollout_id": "t0000_g0", "group_id": "t0000", "attempt": 1}
    lines = [
        line(0, "actor_started"),
        line(1, "rollout_started", **ids),
        line(2, "turn_started", turn=0, **ids),
        line(3, "actor_started"),  # the agent's process died inside turn 0 and came back
        line(4, "rollout_started", **ids),
        *(line(5 + turn, "turn_started", turn=turn, **ids) for turn in range(2)),
        line(7, "turn_finished", turn=1, **ids),
        line(8, "rollout_completed", **ids),
    ]
    attempt = report.build_timeline(lines, RUN).rollouts["t0000_g0"].attempts[1]
    assert [t.index for t in attempt.turns] == [0, 1] and not any(t.cut for t in attempt.turns)
    assert [(t.index, t.cut) for t in attempt.superseded] == [(0, True)]
    assert attempt.outcome == "completed"
