"""A Run this controller never dispatched (an operator's, a script's, a fuzzer's) running on an agent
when a snapshot cuts it: the snapshot leaves it out, counts and names it, and publishes; the run's own
rollouts are saved and sealed as ever. (Found by the fuzz: one stray Run that outlived the fuzzing
ended the whole run's snapshots as an invariant broken.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import structlog
from parkway.actors.builtin.trainers import ExampleTrainer
from parkway.actors.roles.agent import Agent
from parkway.actors.run.config import from_dict
from parkway.actors.runtime.client import Client
from parkway.protocol.anchor import decode_ledger_file
from parkway.protocol.layout import LEDGER, MANIFEST
from parkway.protocol.ledger import Ledger
from parkway.protocol.messages import Run

from tests.support.embedded import started_cluster
from tests.support.signed import SECRET
from tests.support.waiting import until

CONFIG = {
    "run": "foreign",
    "seed": 13,
    "policy": {"host": "inline", "per_token_delay_s": 0.0003},
    "tasks": {"builtin": "bank", "limit": 2},
    "rollout": {"group_size": 2, "max_turns": 4},
    "topology": {"agents": 1, "resources": 1},
    "trainer": {"batch_groups": 1},
    "snapshot_interval_s": 3600.0,  # only the snapshot the test asks for
}
STRAY = ("stray_g0", 0)


async def test_a_run_the_controller_never_dispatched_is_left_out_of_its_snapshot(tmp_path: Path) -> None:
    config = from_dict(CONFIG)
    controller, actors, workload = await started_cluster(config, tmp_path, ExampleTrainer())
    agent = next(a for a in actors if isinstance(a, Agent))
    operator = Client(controller.broker, secret=SECRET, sender="operator/0")
    try:
        await until(lambda: controller.counts["attempts_dispatched"] > 0, timeout=30)
        # Forty turns of the counter agent: far more than the few ms until the Prepare reaches it.
        stray = Run(
            rollout_id=STRAY[0],
            attempt=STRAY[1],
            group_id="stray",
            env="counter",
            prompt="count",
            max_turns=40,
            epoch=controller.state.epoch,
        )
        await operator.send(agent.address, stray, correlation_id=STRAY[0])
        await until(lambda: STRAY in agent.live, timeout=30)
        with structlog.testing.capture_logs() as logs:
            published = await controller.take_snapshot()
        assert published is not None, "a stray Run ended or failed the snapshot"
        assert controller.counts["cut_foreign"] == 1
        warning = next(e for e in logs if e["event"] == "foreign_attempts_in_cut")
        assert warning["log_level"] == "warning" and warning["attempts"] == ["stray_g0@0 on agent/0"]
        saved = Ledger.load(decode_ledger_file((published.path / LEDGER).read_bytes()).ledger)
        assert not saved.knows(STRAY[0])
        manifest = json.loads((published.path / MANIFEST).read_text())
        episodes = {(rollout_id, attempt) for rollout_id, attempt in manifest["episodes"]}
        assert episodes and STRAY not in episodes and len(episodes) == published.episodes
        assert all(saved.knows(rollout_id) for rollout_id, _ in episodes)
        summary = await asyncio.wait_for(workload, 120)
    finally:
        workload.cancel()
        await asyncio.gather(workload, return_exceptions=True)
    assert summary.rollouts_sealed == summary.rollouts_expected == 4 and summary.rollouts_failed == 0
    assert summary.snapshots_published >= 1 and summary.snapshots_failed == 0
