"""A Run dispatched after a snapshot's instant (docs/snapshots.md#the-window), in memory with every
actor in one process. The gate opens once the agents' Prepares are with the broker, so the controller
dispatches while its agents cut. Both orders are forced, not waited for by chance:

- the Run reaches its agent after that agent cut: the snapshot saves nothing of it and names it among
  its ``restarts``; a restore from it starts the rollout from its prompt (attempt N+1, N fenced), and
  the run ends with every rollout sealed once and the transcripts of a run that never stopped;
- the Run reaches its agent first: that agent's cut holds it, and it is saved like any other."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.builtin.trainers import ExampleTrainer
from parkway.actors.roles.agent import Agent
from parkway.actors.roles.controller import cut
from parkway.actors.roles.controller.save import SAVE_STEPS, SaveSequence
from parkway.actors.roles.tq import TransferQueue, TransferStore
from parkway.actors.run.config import from_dict
from parkway.protocol.anchor import decode_ledger_file
from parkway.protocol.ids import Role, capture_key
from parkway.protocol.layout import LEDGER, MANIFEST, participant_dir
from parkway.protocol.ledger import Ledger
from parkway.protocol.messages import Prepare, Run
from parkway.protocol.snapshot import SaveStep

from tests.support.embedded import embedded_run, started_cluster
from tests.support.waiting import until

CONFIG = {
    "run": "instant",
    "seed": 17,
    "policy": {"host": "inline", "per_token_delay_s": 0.0003},
    "tasks": {"builtin": "bank", "limit": 4},
    # Three in flight of twelve: a rollout that ends frees a slot, and the next is dispatched at once.
    "rollout": {"group_size": 3, "max_turns": 4, "max_in_flight": 3},
    "topology": {"agents": 1, "resources": 1},
    "trainer": {"batch_groups": 1},
    "snapshot_interval_s": 3600.0,  # only the snapshot the test asks for
}
Key = tuple[str, int]


def manifest_of(path: Path) -> tuple[set[Key], set[Key]]:
    manifest = json.loads((path / MANIFEST).read_text())
    return {tuple(e) for e in manifest["episodes"]}, {tuple(e) for e in manifest["restarts"]}  # type: ignore[misc]


def instants(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[Key]]:
    """The attempts dispatched at each snapshot's instant, by checkpoint id, noted right after it (in
    the same stretch of the event loop: nothing was dispatched since)."""
    noted: dict[str, set[Key]] = {}
    instant = cut.instant

    async def noting(self: SaveSequence, attempt: Any, stages: Any) -> None:
        await instant(self, attempt, stages)
        if attempt.skip_reason is None:
            noted[attempt.checkpoint_id] = self.host.ledger.dispatched_by(attempt.mark)

    monkeypatch.setitem(SAVE_STEPS, SaveStep.INSTANT, noting)
    return noted


async def test_a_run_that_reaches_its_agent_after_the_cut_restarts_from_its_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = await embedded_run(CONFIG, tmp_path / "reference", snapshots=False)
    noted = instants(monkeypatch)
    on_prepare, on_run = Agent.on_prepare, Agent.on_run
    answered: set[str] = set()
    late: set[Key] = set()

    async def prepare_after_a_dispatch(self: Agent, command: Prepare) -> Any:
        # Unread until a rollout that ended frees a slot, the controller dispatches into it and that
        # Run is here (held below until this cut is taken).
        await until(lambda: bool(late), timeout=30)
        try:
            return await on_prepare(self, command)  # (the cut is taken as it returns)
        finally:
            answered.add(command.checkpoint_id)

    async def run_after_the_cut(self: Agent, run: Run) -> None:
        # A Run dispatched after the instant waits until its agent has cut.
        pending = [cid for cid in noted if cid not in answered]
        if pending and (run.rollout_id, run.attempt) not in noted[pending[0]]:
            late.add((run.rollout_id, run.attempt))
            await until(lambda: pending[0] in answered, timeout=30)
        await on_run(self, run)

    tqs: list[TransferQueue] = []
    prepared = cut.prepared

    async def copied_once_it_made_a_row(self: SaveSequence, attempt: Any, stages: Any) -> None:
        # The ledger is copied (and TQ's cut sent) once a Run held above has a row in TQ: rows of an
        # attempt no cut holds, which the snapshot must leave out.
        await prepared(self, attempt, stages)
        await until(lambda: any(capture_key(*key) in tqs[0].store.staging for key in late), timeout=30)

    monkeypatch.setattr(Agent, "on_prepare", prepare_after_a_dispatch)
    monkeypatch.setattr(Agent, "on_run", run_after_the_cut)
    monkeypatch.setitem(SAVE_STEPS, SaveStep.PREPARED, copied_once_it_made_a_row)
    config = from_dict(CONFIG)
    state = tmp_path / "state"
    controller, actors, workload = await started_cluster(config, state, ExampleTrainer())
    tqs.extend(a for a in actors if isinstance(a, TransferQueue))
    try:
        await until(lambda: controller.counts["rollouts_sealed"] >= 1, timeout=30)
        published = await controller.take_snapshot()
        assert published is not None
    finally:
        workload.cancel()  # the cluster dies right after it
        await asyncio.gather(workload, return_exceptions=True)

    [at_instant] = noted.values()
    episodes, restarts = manifest_of(published.path)
    after = restarts
    assert late and late <= after and not after & at_instant  # (others may have come after the cut too)
    saved = Ledger.load(decode_ledger_file((published.path / LEDGER).read_bytes()).ledger)
    # Saved running in the ledger, in no agent's cut, and named to restart: the snapshot holds it.
    assert after <= saved.dispatched() and not after & episodes and after <= restarts
    assert episodes == saved.dispatched() - after and episodes  # the others cut as ever
    assert controller.counts["dispatched_after_cut"] == len(after)
    # TQ's cut leaves out the rows they made (a restore generates them again: no work it saved).
    saved_rows = TransferStore.load(published.path / participant_dir(Role.TQ, 0))
    assert not {capture_key(*key) for key in after} & set(saved_rows.staging)
    assert saved_rows.staging and not {
        lineage for lineage in saved_rows.generations if lineage[0] in {r for r, _ in after}
    }

    again, _, resumed = await started_cluster(config, state, ExampleTrainer())
    summary = await asyncio.wait_for(resumed, 120)
    assert summary.restores == 1
    # Every rollout running at the snapshot got attempt N+1; those cut continue their transcripts,
    # the ones dispatched after the instant start from their prompts.
    assert again.counts["attempts_restarted"] == len(saved.dispatched())
    assert again.counts["rollouts_restored"] == len(episodes)
    assert summary.rollouts_sealed == summary.rollouts_expected == 12 and summary.rollouts_failed == 0
    assert summary.attempts_failed == 0
    assert summary.transcripts_sha256 == reference.transcripts_sha256


async def test_a_run_that_reaches_its_agent_before_its_prepare_is_in_its_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = await embedded_run(CONFIG, tmp_path / "reference", snapshots=False)
    noted = instants(monkeypatch)
    on_prepare = Agent.on_prepare
    early: set[Key] = set()

    async def after_a_dispatch(self: Agent, command: Prepare) -> Any:
        # The Prepare waits here, unread, until a Run dispatched after its instant is running.
        await until(lambda: command.checkpoint_id in noted, timeout=30)
        at_instant = noted[command.checkpoint_id]
        await until(lambda: bool(set(self.live) - at_instant), timeout=30)
        early.update(set(self.live) - at_instant)
        return await on_prepare(self, command)

    monkeypatch.setattr(Agent, "on_prepare", after_a_dispatch)
    controller, _, workload = await started_cluster(from_dict(CONFIG), tmp_path / "state", ExampleTrainer())
    try:
        await until(lambda: controller.counts["rollouts_sealed"] >= 1, timeout=30)
        published = await controller.take_snapshot()
        assert published is not None
        summary = await asyncio.wait_for(workload, 120)
    finally:
        workload.cancel()
        await asyncio.gather(workload, return_exceptions=True)

    episodes, restarts = manifest_of(published.path)
    assert early and early <= episodes and not early & restarts  # in the cut, saved like any other
    assert controller.counts["dispatched_after_cut"] == len(restarts)  # (any that came after its cut)
    assert summary.rollouts_sealed == summary.rollouts_expected == 12 and summary.rollouts_failed == 0
    assert summary.attempts_failed == 0 and summary.transcripts_sha256 == reference.transcripts_sha256
